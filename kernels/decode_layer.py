"""One decoded token's whole DeltaNet layer in one compiled call: h += mixer(rmsnorm(h)), then h += moe(rmsnorm(h)).

Done from Python, a DeltaNet layer of a decoded token was seven kernel calls (the norm, the input projections,
the DeltaNet step, the output projection, the second norm, the MoE block) and some 150 Python calls between them:
the architecture's glue, the device's dispatch, argument checks, the residual adds. A decoded token's Python runs
with cold caches (each layer streams megabytes of weights through them), so that glue cost ~0.4-1.3 ms of an
80B-shaped token of 7-10 ms (bench/bench_replay.py: the same kernels called back to back). Here the layer's
kernels run in turn from compiled code, and Python enters once.

Every step is the kernel the layered path calls, on the same inputs, in the same order (the norms'
_rmsnorm_rows, quant_dispatch's matvec_int / matvecs_int / matvec_int_serial, deltanet._decode_step,
moe_token._moe_token), and the residual adds are float32 adds as numpy's: the results are the layered path's,
bit for bit. The integer path only (quantized activations, integer dots for every projection); anything else
stays on the layered path (DeltaNetMoELayerCall.make returns None).
"""

from __future__ import annotations

import numba
import numpy as np

from .deltanet import DecodeStep, _decode_step
from .moe_token import MoETokenCall, _moe_token
from .norms import _rmsnorm_rows
from .quant import _SERIAL_MATVEC_BYTES, _check_weights, _format, _read_only
from .quant_dispatch import has_int_dot, matvec_int, matvec_int_serial, matvecs_int

Projection = tuple[np.ndarray, int]  # a matrix's rows (uint8, ggml blocks) and its ggml type


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
    mixed = np.empty(hidden, np.float32)
    if out_serial:
        matvec_int_serial(out_t, out_w, o, out_block, mixed)
    else:
        matvec_int(out_t, out_w, o, out_block, mixed, 0)
    for i in range(hidden):
        h[i] += mixed[i]
    _rmsnorm_rows(h.reshape(1, hidden), ffn_norm, eps, x)
    ids = np.empty(k, np.int64)
    weights = np.empty(k, np.float32)
    moe = np.zeros(hidden, np.float32)
    (rt, router, it, gate_inp, normalize, tg, gate, tu, up, td, down, stg, sgate, stu, sup, std, sdown) = moe_w
    _moe_token(rt, router, it, gate_inp, normalize, tg, gate, tu, up, td, down, stg, sgate, stu, sup, std, sdown,
               x[0], quantized, moe_blocks, ids, weights, moe, 0)
    for i in range(hidden):
        h[i] += moe[i]


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
        hidden = moe.hidden
        for name, w in (("attn_norm", attn_norm), ("ffn_norm", ffn_norm)):
            if not (isinstance(w, np.ndarray) and w.dtype == np.float32 and w.shape == (hidden,)):
                raise ValueError(f"{name} must be float32 [{hidden}]")
        (qkv, _), (z, _), (ba, _) = proj
        hv, dv = step.hv, step.dv
        if qkv.shape[0] != step.channels or z.shape[0] != hv * dv or ba.shape[0] != 2 * hv:
            raise ValueError(f"the input projections must give {step.channels} q/k/v channels, {hv * dv} gate "
                             f"and {2 * hv} beta/alpha rows; got {qkv.shape[0]}, {z.shape[0]}, {ba.shape[0]}")
        for w, t in proj:
            _check_weights(w, _format(t), hidden)
        _check_weights(out[0], _format(out[1]), hv * dv)
        if out[0].shape[0] != hidden:
            raise ValueError(f"the output projection must have {hidden} rows, got {out[0].shape[0]}")
        if not (step.fused_ba and moe.quantized and all(has_int_dot(t) for _, t in (*proj, out))):
            raise ValueError("DeltaNetMoELayerCall takes fused beta/alpha rows, quantized activations and "
                             "integer dots for every projection (see make)")
        types = [t for _, t in proj]
        ws = tuple(_read_only(w) for w, _ in proj)  # one compiled tuple type (Numba types writability too)
        self.hidden = hidden
        self._args = (  # _deltanet_moe_layer's arguments after h and the states
            attn_norm, ffn_norm, float(eps), ws, np.array(types, np.int64),
            np.array([max(1, _format(t).act_block) for t in types], np.int64),
            np.array([w.nbytes <= _SERIAL_MATVEC_BYTES for w in ws]),
            bool(len(set(types)) == 1 and sum(w.nbytes for w in ws) > _SERIAL_MATVEC_BYTES),
            qkv.shape[0], z.shape[0], *step.kernel_weights(),
            _read_only(out[0]), int(out[1]), max(1, _format(out[1]).act_block),
            bool(out[0].nbytes <= _SERIAL_MATVEC_BYTES), *moe.kernel_weights())
        self._step = step

    @classmethod
    def make(cls, attn_norm: np.ndarray, ffn_norm: np.ndarray, eps: float, proj: tuple[Projection, ...],
             step: DecodeStep, out: Projection, moe: MoETokenCall | None) -> DeltaNetMoELayerCall | None:
        """The call, or None where this layer has no such path: no fused MoE call, float activations, beta and
        alpha stored apart, or a projection without an integer dot."""
        if moe is None or not moe.quantized or not step.fused_ba or len(proj) != 3:
            return None
        if not all(has_int_dot(t) for _, t in (*proj, out)):
            return None
        return cls(attn_norm, ffn_norm, eps, proj, step, out, moe)

    def __call__(self, h: np.ndarray, conv_state: np.ndarray, state: np.ndarray) -> None:
        if not (h.dtype == np.float32 and h.shape == (self.hidden,) and h.flags.c_contiguous and h.flags.writeable):
            raise ValueError(f"h must be a writable contiguous float32 [{self.hidden}]")
        self._step.check_states(conv_state, state)
        _deltanet_moe_layer(h, conv_state, state, *self._args)
