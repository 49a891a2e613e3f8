"""One decoded token's whole layer in one compiled call: h += mixer(rmsnorm(h)), then h += moe(rmsnorm(h)), the mixer
a gated DeltaNet (DeltaNetMoELayerCall) or attention over a KV cache (AttentionMoELayerCall).

Done from Python, a DeltaNet layer of a decoded token was six kernel calls (the norm, the input projections, the
DeltaNet step, the output projection, the second norm, the MoE block), an attention layer eleven, with some 150
Python calls between them: the architecture's glue, the device's dispatch, argument checks, the residual adds. A
decoded token's Python runs with cold caches (each layer streams megabytes of weights through them), so that glue
cost ~0.4-1.3 ms of an 80B-shaped token of 7-10 ms (bench/bench_replay.py: the same kernels called back to back).
Here the layer's kernels run in turn from compiled code, and Python enters once.

Every step is the kernel the layered path calls, on the same inputs, in the same order (the norms'
_rmsnorm_rows, quant_dispatch's matvec_int / matvecs_int / matvec_int_serial, deltanet._decode_step, attention's
_rope_neox and _attend with attend's split of the keys, activations._mul_sigmoid, moe_token._moe_token), and the
residual adds are float32 adds as numpy's: the results are the layered path's, bit for bit. The integer path only
(quantized activations, integer dots for every projection); anything else stays on the layered path (``make``
returns None).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from .activations import _mul_sigmoid
from .attention import _KEY_BLOCK, _MIN_KEYS_PER_SPLIT, _ROWS_PER_ITEM, _attend, _inv_freq, _rope_neox
from .deltanet import DecodeStep, _decode_step
from .moe_token import MoETokenCall, _moe_token
from .norms import _rmsnorm_rows
from .quant import _SERIAL_MATVEC_BYTES, _check_weights, _format, _read_only
from .quant_dispatch import has_int_dot, matvec_int, matvec_int_serial, matvecs_int

Projection = tuple[np.ndarray, int]  # a matrix's rows (uint8, ggml blocks) and its ggml type


class AttentionShape(NamedTuple):
    """An attention layer's geometry as the decode call takes it: q holds per head its query, then its gate where
    gated; NEOX RoPE over the first rope_dim dims of each head with base rope_theta; scale: the softmax scale."""
    heads: int
    kv_heads: int
    head_dim: int
    gated: bool
    rope_theta: float
    rope_dim: int
    scale: float


@numba.njit(nogil=True, cache=True, fastmath=False)
def _project(ws, types, blocks, serial, stacked, x, out):
    """out = the matrices ws (a tuple, one after another in out) times x: one parallel region where stacked (one
    type, the matrices large), else each on its own, as quant.MatvecsCall groups them (the same bits either way)."""
    if stacked:
        matvecs_int(types[0], ws, x, blocks[0], out, 0)
        return
    first = 0
    for i in range(len(ws)):
        w = ws[i]
        part = out[first:first + w.shape[0]]
        if serial[i]:
            matvec_int_serial(types[i], w, x, blocks[i], part)
        else:
            matvec_int(types[i], w, x, blocks[i], part, 0)
        first += w.shape[0]


@numba.njit(nogil=True, cache=True, fastmath=False)
def _output_and_moe(h, o, out_w, out_t, out_block, out_serial, ffn_norm, eps, moe_w, quantized, moe_blocks, k):
    """h += out_w @ o, then h += the MoE block of rmsnorm(h): a decoded layer's second half."""
    hidden = h.shape[0]
    mixed = np.empty(hidden, np.float32)
    if out_serial:
        matvec_int_serial(out_t, out_w, o, out_block, mixed)
    else:
        matvec_int(out_t, out_w, o, out_block, mixed, 0)
    for i in range(hidden):
        h[i] += mixed[i]
    x = np.empty((1, hidden), np.float32)
    _rmsnorm_rows(h.reshape(1, hidden), ffn_norm, eps, x)
    ids = np.empty(k, np.int64)
    weights = np.empty(k, np.float32)
    moe = np.zeros(hidden, np.float32)
    (rt, router, it, gate_inp, normalize, tg, gate, tu, up, td, down, stg, sgate, stu, sup, std, sdown) = moe_w
    _moe_token(rt, router, it, gate_inp, normalize, tg, gate, tu, up, td, down, stg, sgate, stu, sup, std, sdown,
               x[0], quantized, moe_blocks, ids, weights, moe, 0)
    for i in range(hidden):
        h[i] += moe[i]


@numba.njit(nogil=True, cache=True, fastmath=False)
def _deltanet_moe_layer(h, conv_state, state, attn_norm, ffn_norm, eps, proj, ptypes, pblocks, pserial, pstacked,
                        rows_qkv, rows_z, step_w, step_rest, out_w, out_t, out_block, out_serial, moe_w, quantized,
                        moe_blocks, k):
    hidden = h.shape[0]
    x = np.empty((1, hidden), np.float32)
    _rmsnorm_rows(h.reshape(1, hidden), attn_norm, eps, x)
    y = np.empty(rows_qkv + rows_z + proj[2].shape[0], np.float32)
    _project(proj, ptypes, pblocks, pserial, pstacked, x[0], y)
    conv_w_t, ssm_a, dt_bias = step_w
    norm_w, step_eps, hk, dk, hv, dv, tiled, silu_gate, scale = step_rest
    o = np.empty(hv * dv, np.float32)
    _decode_step(y[:rows_qkv], y[rows_qkv:rows_qkv + rows_z], y[rows_qkv + rows_z:], True, conv_state, conv_w_t,
                 ssm_a, dt_bias, state, norm_w, step_eps, hk, dk, hv, dv, tiled, silu_gate, scale, o)
    _output_and_moe(h, o, out_w, out_t, out_block, out_serial, ffn_norm, eps, moe_w, quantized, moe_blocks, k)


@numba.njit(nogil=True, cache=True, fastmath=False)
def _attention_moe_layer(h, k_cache, v_cache, start, position, attn_norm, ffn_norm, eps, proj, ptypes, pblocks,
                         pserial, pstacked, q_norm, k_norm, heads, kv_heads, d, gated, inv_freq, scale, threads,
                         out_w, out_t, out_block, out_serial, moe_w, quantized, moe_blocks, k):
    hidden = h.shape[0]
    x = np.empty((1, hidden), np.float32)
    _rmsnorm_rows(h.reshape(1, hidden), attn_norm, eps, x)
    nq, nk = proj[0].shape[0], proj[1].shape[0]
    y = np.empty(nq + nk + proj[2].shape[0], np.float32)
    _project(proj, ptypes, pblocks, pserial, pstacked, x[0], y)
    # q (per head its query, then its gate where gated), k: RMSNorm per head, then RoPE at `position`
    per_head = 2 * d if gated else d
    q = np.empty((heads, d), np.float32)
    gate = np.empty(heads * d, np.float32)
    for head in range(heads):
        q[head] = y[head * per_head:head * per_head + d]
        if gated:
            gate[head * d:(head + 1) * d] = y[head * per_head + d:(head + 1) * per_head]
    normed = np.empty((1, heads, d), np.float32)
    _rmsnorm_rows(q, q_norm, eps, normed[0])
    k_normed = np.empty((1, kv_heads, d), np.float32)
    _rmsnorm_rows(y[nq:nq + nk].reshape(kv_heads, d), k_norm, eps, k_normed[0])
    positions = np.full(1, position, np.int64)
    q_rot = np.empty((1, heads, d), np.float32)
    _rope_neox(normed, positions, inv_freq, q_rot)
    _rope_neox(k_normed, positions, inv_freq, k_cache[start:start + 1])  # the new key and value into the cache
    v_cache[start] = y[nq + nk:].reshape(kv_heads, d)
    # attention.attend's split of the keys for one query (the same bits need the same split)
    group = heads // kv_heads
    q_block = max(1, _ROWS_PER_ITEM // group)
    n_keys = start + 1
    most = (n_keys + _MIN_KEYS_PER_SPLIT - 1) // _MIN_KEYS_PER_SPLIT
    splits = 1 if most <= 1 else min((threads + kv_heads - 1) // kv_heads, most)
    span = ((n_keys + splits - 1) // splits + _KEY_BLOCK - 1) // _KEY_BLOCK * _KEY_BLOCK
    splits = (n_keys + span - 1) // span
    parts = kv_heads * splits if splits > 1 else 0
    attended = np.empty((1, heads, v_cache.shape[2]), np.float32)
    _attend(q_rot, k_cache, v_cache, start, scale, q_block, splits, span, attended,
            np.empty((parts, q_block * group, v_cache.shape[2]), np.float32),
            np.empty((parts, q_block * group), np.float32), np.empty((parts, q_block * group), np.float64))
    o = attended.reshape(heads * v_cache.shape[2])
    if gated:
        o = np.empty(heads * d, np.float32)
        _mul_sigmoid(attended.reshape(heads * d), gate, o)
    _output_and_moe(h, o, out_w, out_t, out_block, out_serial, ffn_norm, eps, moe_w, quantized, moe_blocks, k)


def _check_norms(hidden: int, **norms: np.ndarray) -> None:
    for name, w in norms.items():
        if not (isinstance(w, np.ndarray) and w.dtype == np.float32 and w.shape == (hidden,)):
            raise ValueError(f"{name} must be float32 [{hidden}]")


def _projection_args(proj: tuple[Projection, ...], hidden: int) -> tuple:
    """_project's arguments for the matrices proj on an input of `hidden` values."""
    for w, t in proj:
        _check_weights(w, _format(t), hidden)
    types = [t for _, t in proj]
    ws = tuple(_read_only(w) for w, _ in proj)  # one compiled tuple type (Numba types writability too)
    return (ws, np.array(types, np.int64), np.array([max(1, _format(t).act_block) for t in types], np.int64),
            np.array([w.nbytes <= _SERIAL_MATVEC_BYTES for w in ws]),
            bool(len(set(types)) == 1 and sum(w.nbytes for w in ws) > _SERIAL_MATVEC_BYTES))


def _output_args(out: Projection, hidden: int, length: int, moe: MoETokenCall) -> tuple:
    """_output_and_moe's weight arguments: the output projection [hidden, length] and the MoE block's."""
    _check_weights(out[0], _format(out[1]), length)
    if out[0].shape[0] != hidden:
        raise ValueError(f"the output projection must have {hidden} rows, got {out[0].shape[0]}")
    return (_read_only(out[0]), int(out[1]), max(1, _format(out[1]).act_block),
            bool(out[0].nbytes <= _SERIAL_MATVEC_BYTES), *moe.kernel_weights())


def _has_int_path(projections: tuple[Projection, ...], moe: MoETokenCall | None) -> bool:
    return moe is not None and moe.quantized and all(has_int_dot(t) for _, t in projections)


def _check_h(h: np.ndarray, hidden: int) -> None:
    if not (h.dtype == np.float32 and h.shape == (hidden,) and h.flags.c_contiguous and h.flags.writeable):
        raise ValueError(f"h must be a writable contiguous float32 [{hidden}]")


class DeltaNetMoELayerCall:
    """A DeltaNet layer for decoded tokens, its weights checked once: ``call(h, conv_state, state)`` adds the
    layer's mixer and MoE block to the residual stream h (float32 [hidden], in place), advancing the DeltaNet
    states as DecodeStep does.

    attn_norm, ffn_norm: the two RMSNorm weights [hidden] (GGUF's, eps shared); proj: the input projections
    (q/k/v channels, the gate z, the fused beta/alpha rows, as DecodeStep takes them); step: the layer's
    DecodeStep (fused beta/alpha); out: the output projection [hidden, hv * dv]; moe: the layer's MoETokenCall
    (quantized activations). Make it with ``make``, which returns None where a part has no integer path here.
    """

    def __init__(self, attn_norm: np.ndarray, ffn_norm: np.ndarray, eps: float, proj: tuple[Projection, ...],
                 step: DecodeStep, out: Projection, moe: MoETokenCall):
        hidden, hv, dv = moe.hidden, step.hv, step.dv
        _check_norms(hidden, attn_norm=attn_norm, ffn_norm=ffn_norm)
        (qkv, _), (z, _), (ba, _) = proj
        if qkv.shape[0] != step.channels or z.shape[0] != hv * dv or ba.shape[0] != 2 * hv:
            raise ValueError(f"the input projections must give {step.channels} q/k/v channels, {hv * dv} gate "
                             f"and {2 * hv} beta/alpha rows; got {qkv.shape[0]}, {z.shape[0]}, {ba.shape[0]}")
        if not (step.fused_ba and _has_int_path((*proj, out), moe)):
            raise ValueError("DeltaNetMoELayerCall takes fused beta/alpha rows, quantized activations and "
                             "integer dots for every projection (see make)")
        self.hidden = hidden
        self._args = (attn_norm, ffn_norm, float(eps), *_projection_args(proj, hidden), qkv.shape[0], z.shape[0],
                      *step.kernel_weights(), *_output_args(out, hidden, hv * dv, moe))
        self._step = step

    @classmethod
    def make(cls, attn_norm: np.ndarray, ffn_norm: np.ndarray, eps: float, proj: tuple[Projection, ...],
             step: DecodeStep, out: Projection, moe: MoETokenCall | None) -> DeltaNetMoELayerCall | None:
        """The call, or None where this layer has no such path: no fused MoE call, float activations, beta and
        alpha stored apart, or a projection without an integer dot."""
        if len(proj) != 3 or not step.fused_ba or not _has_int_path((*proj, out), moe):
            return None
        return cls(attn_norm, ffn_norm, eps, proj, step, out, moe)

    def __call__(self, h: np.ndarray, conv_state: np.ndarray, state: np.ndarray) -> None:
        _check_h(h, self.hidden)
        self._step.check_states(conv_state, state)
        _deltanet_moe_layer(h, conv_state, state, *self._args)


class AttentionMoELayerCall:
    """An attention layer for decoded tokens, its weights checked once: ``call(h, k_cache, v_cache, start,
    position)`` adds the layer's attention and MoE block to h (float32 [hidden], in place), the token's key and
    value written to row `start` of the caches ([rows > start, kv_heads, head_dim] float32) and attended with rows
    0..start; the caller then counts the row as filled.

    proj: the q, k and v projections (see AttentionShape); q_norm, k_norm: the per-head RMSNorm weights
    [head_dim]; threads: the thread count the attention's key ranges are split for (attention.attend's rule); out:
    the output projection [hidden, heads * head_dim]; moe: the layer's MoETokenCall (quantized activations). As
    attention.rope, attend and mul_sigmoid compute it, the same bits. Make it with ``make``.
    """

    def __init__(self, attn_norm: np.ndarray, ffn_norm: np.ndarray, eps: float, proj: tuple[Projection, ...],
                 q_norm: np.ndarray, k_norm: np.ndarray, shape: AttentionShape, threads: int, out: Projection,
                 moe: MoETokenCall):
        heads, kv_heads, head_dim, gated, rope_theta, rope_dim, scale = shape
        hidden = moe.hidden
        _check_norms(hidden, attn_norm=attn_norm, ffn_norm=ffn_norm)
        _check_norms(head_dim, q_norm=q_norm, k_norm=k_norm)
        rows = ((2 if gated else 1) * heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        if len(proj) != 3 or tuple(w.shape[0] for w, _ in proj) != rows:
            raise ValueError(f"the q, k and v projections must give {rows} rows")
        if heads % kv_heads or rope_dim % 2 or not 0 < rope_dim <= head_dim or threads < 1:
            raise ValueError("heads must be a multiple of kv_heads, rope_dim even and in 2..head_dim, threads >= 1")
        if not _has_int_path((*proj, out), moe):
            raise ValueError("AttentionMoELayerCall takes quantized activations and integer dots for every "
                             "projection (see make)")
        self.hidden, self._kv = hidden, (kv_heads, head_dim)
        self._args = (attn_norm, ffn_norm, float(eps), *_projection_args(proj, hidden), q_norm, k_norm, int(heads),
                      int(kv_heads), int(head_dim), bool(gated), _inv_freq(float(rope_theta), int(rope_dim)),
                      np.float32(scale), int(threads), *_output_args(out, hidden, heads * head_dim, moe))

    @classmethod
    def make(cls, attn_norm: np.ndarray, ffn_norm: np.ndarray, eps: float, proj: tuple[Projection, ...],
             q_norm: np.ndarray, k_norm: np.ndarray, shape: AttentionShape, threads: int, out: Projection,
             moe: MoETokenCall | None) -> AttentionMoELayerCall | None:
        """The call, or None where this layer has no such path: no fused MoE call, float activations, or a
        projection without an integer dot."""
        if not _has_int_path((*proj, out), moe):
            return None
        return cls(attn_norm, ffn_norm, eps, proj, q_norm, k_norm, shape, threads, out, moe)

    def __call__(self, h: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int, position: int) -> None:
        _check_h(h, self.hidden)
        for cache in (k_cache, v_cache):
            if not (cache.dtype == np.float32 and cache.ndim == 3 and cache.shape[1:] == self._kv
                    and cache.flags.c_contiguous and cache.flags.writeable and 0 <= start < cache.shape[0]):
                raise ValueError(f"the caches must be writable float32 [> {start}, {self._kv[0]}, {self._kv[1]}]")
        _attention_moe_layer(h, k_cache, v_cache, int(start), int(position), *self._args)
