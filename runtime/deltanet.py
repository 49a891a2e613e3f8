"""The gated DeltaNet token mixer (Qwen3-Next linear attention) over GGUF weights.

    q, k, v = split(silu(causal_conv1d(W_qkv x)))          per-channel conv over the last `kernel` tokens
    q, k    = l2norm(q), l2norm(k)                           per key head
    g       = ssm_a * softplus(a + dt_bias),  beta = sigmoid(b)      from the ba projection
    o       = gated_delta_rule(q, k, v, g, beta)             recurrent state [v_heads, k_dim, v_dim]
    out     = W_out (rmsnorm(o) * norm * silu(z))            z = W_z x, per value head (or sigmoid(z))

A prompt chunk runs the chunked delta rule, a single decode token the recurrent one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata_async.kernels import deltanet

from .device import Device
from .layers import gate_sigmoid, gated_rmsnorm, l2norm, rmsnorm
from .state import DeltaNetState
from .weights import QTensor


@dataclass(frozen=True)
class DeltaNetShape:
    n_k_heads: int
    n_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    # Value heads of key head kh: kh * r .. kh * r + r - 1 ("grouped", r = v_heads / k_heads, Qwen3-Next files)
    # or kh, kh + k_heads, kh + 2 k_heads, .. ("tiled": converters reorder Qwen3.5-style checkpoints so).
    v_head_order: str = "grouped"
    gate: str = "silu"  # activation of the output gate z: "silu" or "sigmoid"

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def new_state(self) -> DeltaNetState:
        return DeltaNetState.zeros(self.conv_kernel, self.conv_dim, self.n_v_heads, self.k_dim, self.v_dim)


@dataclass(frozen=True)
class InputProjection:
    """x -> (qkv [n, conv_dim], z [n, value_dim]).

    Files from current converters store W_qkv (all q heads, all k heads, all v heads) and W_z
    (attn_qkv / attn_gate). Older ones store the original fused W_qkvz (ssm_in), whose rows interleave
    [q, k, v, z] per key head; its output columns are then reordered with ``qkv_cols`` / ``z_cols``.
    """

    qkv: QTensor | None = None
    z: QTensor | None = None
    qkvz: QTensor | None = None
    qkv_cols: np.ndarray | None = None
    z_cols: np.ndarray | None = None

    @classmethod
    def fused(cls, qkvz: QTensor, shape: DeltaNetShape) -> InputProjection:
        r = shape.n_v_heads // shape.n_k_heads
        group = 2 * shape.k_dim + 2 * r * shape.v_dim  # columns per key head
        col = np.arange(shape.n_k_heads * group).reshape(shape.n_k_heads, group)
        q, k, v, z = np.split(col, np.cumsum([shape.k_dim, shape.k_dim, r * shape.v_dim]), axis=1)
        return cls(qkvz=qkvz, qkv_cols=np.concatenate([q.ravel(), k.ravel(), v.ravel()]), z_cols=z.ravel())

    def __call__(self, dev: Device, x: np.ndarray, *more: QTensor) -> list[np.ndarray]:
        """[qkv, z, *(x times each of more)]: more are other matrices on the same input (the beta/alpha rows), in
        the same call of dev.linears."""
        if self.qkvz is not None:
            mixed, *rest = dev.linears(x, (self.qkvz, *more))
            return [mixed[:, self.qkv_cols], mixed[:, self.z_cols], *rest]
        return dev.linears(x, (self.qkv, self.z, *more))


@dataclass(frozen=True)
class DeltaNetWeights:
    in_proj: InputProjection
    ba: QTensor | None  # [2 * v_heads, hidden]: per key head, its v_heads/k_heads betas then as many alphas
    conv: np.ndarray  # [conv_dim, kernel]
    dt_bias: np.ndarray  # [v_heads]
    ssm_a: np.ndarray  # [v_heads]: -exp(A_log)
    norm: np.ndarray  # [v_dim]: weight of the gated RMSNorm (stored as is, no +1)
    out: QTensor  # [hidden, value_dim]
    beta: QTensor | None = None  # [v_heads, hidden]: files that store b and a apart instead of ``ba``
    alpha: QTensor | None = None  # [v_heads, hidden]
    _steps: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # decode_step's, by shape

    def decode_step(self, shape: DeltaNetShape, eps: float) -> deltanet.DecodeStep:
        """The decode mixer's compiled step for this layer (made once: its weights are checked then)."""
        step = self._steps.get((shape, eps))
        if step is None:
            s = shape
            step = self._steps[(shape, eps)] = deltanet.DecodeStep(
                self.conv, self.ssm_a, self.dt_bias, self.norm, eps, s.n_k_heads, s.k_dim, s.n_v_heads, s.v_dim,
                fused_ba=self.ba is not None, tiled=s.v_head_order == "tiled", silu_gate=s.gate == "silu")
        return step


def gated_deltanet(dev: Device, x: np.ndarray, w: DeltaNetWeights, shape: DeltaNetShape,
                   state: DeltaNetState, eps: float) -> np.ndarray:
    """The mixer's output [n, hidden] for x [n, hidden]; advances ``state`` by n tokens."""
    n = x.shape[0]
    s = shape
    if n == 1:  # decode: the mixer between the projections in one compiled call
        qkv, z, *ba = w.in_proj(dev, x, *((w.ba,) if w.ba is not None else (w.beta, w.alpha)))
        ba = np.concatenate([b[0] for b in ba]) if len(ba) > 1 else ba[0][0]
        o = w.decode_step(s, eps)(np.ascontiguousarray(qkv[0]), np.ascontiguousarray(z[0]), ba, state.conv,
                                  state.recurrent)
        return dev.linear(o[None, :], w.out)
    qkv, z = w.in_proj(dev, x)
    if w.ba is not None:
        ba = dev.linear(x, w.ba).reshape(n, s.n_k_heads, 2, s.n_v_heads // s.n_k_heads)
        b = np.ascontiguousarray(ba[:, :, 0].reshape(n, s.n_v_heads))
        a = np.ascontiguousarray(ba[:, :, 1].reshape(n, s.n_v_heads))
    else:
        b, a = dev.linear(x, w.beta), dev.linear(x, w.alpha)

    mixed = deltanet.causal_conv1d(np.ascontiguousarray(qkv), state.conv, w.conv)
    q = l2norm(mixed[:, : s.key_dim].reshape(n, s.n_k_heads, s.k_dim))
    k = l2norm(mixed[:, s.key_dim: 2 * s.key_dim].reshape(n, s.n_k_heads, s.k_dim))
    v = np.ascontiguousarray(mixed[:, 2 * s.key_dim:].reshape(n, s.n_v_heads, s.v_dim))
    if s.v_head_order == "tiled" and s.n_v_heads != s.n_k_heads:
        # The kernels pair value head h with key head h // (v_heads / k_heads); give each value head its own
        # copy of its key head instead (value head h belongs to key head h % k_heads).
        reps = (1, s.n_v_heads // s.n_k_heads, 1)
        q, k = np.tile(q, reps), np.tile(k, reps)
    g, beta = deltanet.gdn_gates(a, b, w.ssm_a, w.dt_bias)

    if n == 1:
        o = deltanet.gated_delta_rule_recurrent(q, k, v, g, beta, state.recurrent)
    else:
        o = deltanet.gated_delta_rule_chunked(q, k, v, g, beta, state.recurrent)
    z = z.reshape(n, s.n_v_heads, s.v_dim)
    o = gated_rmsnorm(o, z, w.norm, eps) if s.gate == "silu" else gate_sigmoid(rmsnorm(o, w.norm, eps), z)
    return dev.linear(o.reshape(n, s.value_dim), w.out)
