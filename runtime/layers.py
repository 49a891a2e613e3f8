"""Layers shared by the architectures: norms, projections, RoPE, attention over a KV cache, SwiGLU.

Activations are float32 [n_tokens, ...]. Matrix products go through the ``Device``; everything else calls
the CPU kernels. Architecture files build their forward from these functions and never call kernels.
"""

from __future__ import annotations

import numpy as np

from strata_async.kernels import activations, norms
from strata_async.kernels import attention as attention_kernels
from strata_async.kernels.decode_layer import AttentionShape  # noqa: F401  (the architectures' decode calls take it)

from .device import Device
from .state import KVCache
from .weights import QTensor


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis of x [n, d] or x [n, heads, d] (w as GGUF stores it)."""
    x = np.ascontiguousarray(x, np.float32)
    return norms.rmsnorm(x, w, eps) if x.ndim == 2 else norms.rmsnorm_heads(x, w, eps)


def group_rmsnorm(x: np.ndarray, w: np.ndarray, groups: int, eps: float) -> np.ndarray:
    """RMSNorm of each of the `groups` equal slices of every row of x [n, groups * d], times w [groups * d]."""
    n = x.shape[0]
    normed = norms.rmsnorm_heads(np.ascontiguousarray(x, np.float32).reshape(n, groups, -1),
                                 np.ones(x.shape[1] // groups, np.float32), eps)
    return normed.reshape(n, -1) * w


def gated_rmsnorm(x: np.ndarray, gate: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm(x) * w * silu(gate) per head; x, gate [n, heads, d]."""
    return norms.gated_rmsnorm(np.ascontiguousarray(x), np.ascontiguousarray(gate), w, eps)


def l2norm(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum(x^2) + 1e-6) per head; x [n, heads, d]."""
    return norms.l2norm(np.ascontiguousarray(x))


def linear(dev: Device, x: np.ndarray, w: QTensor) -> np.ndarray:
    """x [n, k] @ w.T -> [n, rows]."""
    return dev.linear(x, w)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return activations.sigmoid(x)


def silu(x: np.ndarray) -> np.ndarray:
    return activations.silu(x)


def gate_sigmoid(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """x * sigmoid(gate), one pass (an output gate)."""
    return activations.mul_sigmoid(x, gate)


def swiglu(dev: Device, x: np.ndarray, gate: QTensor, up: QTensor, down: QTensor) -> np.ndarray:
    """down(silu(gate(x)) * up(x))."""
    g, u = dev.linears(x, (gate, up))
    return dev.linear(activations.silu_mul(g, u), down)


def rope(x: np.ndarray, positions: np.ndarray, theta: float, rot_dim: int) -> np.ndarray:
    """NEOX rotary embedding of the first rot_dim dims of each head (pairs i, i + rot_dim/2); x [n, heads, d]."""
    return attention_kernels.rope(np.ascontiguousarray(x), positions, theta, rot_dim)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache, scale: float) -> np.ndarray:
    """Causal attention of n new tokens over the cached positions plus themselves (GQA).

    q [n, heads, d]; k, v [n, kv_heads, d] are appended to the cache first. Returns [n, heads * d].
    """
    n = q.shape[0]
    cache.append(k, v)
    out = attention_kernels.attend(np.ascontiguousarray(q), cache.k, cache.v, cache.length - n, scale)
    return out.reshape(n, -1)


def decoded_attention_layer(call, h: np.ndarray, cache: KVCache, position: int) -> None:
    """h [1, hidden] += a whole attention layer of one decoded token at `position` in place (a call that
    Device.attention_moe_layer made), its key and value appended to the cache."""
    cache.make_room(1)
    call(h[0], cache.k, cache.v, cache.length, position)
    cache.length += 1


def sparse_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache, allowed: np.ndarray,
                     scale: float) -> np.ndarray:
    """Attention of n new tokens over only the cached positions ``allowed`` [n, length after the append] lets
    each see (QSA). q [n, heads, d]; k, v [n, kv_heads, d] are appended to the cache first. Returns
    [n, heads * d]."""
    n = q.shape[0]
    cache.append(k, v)
    return attention_kernels.attend_selected(np.ascontiguousarray(q), cache.k, cache.v, allowed, scale).reshape(n, -1)
