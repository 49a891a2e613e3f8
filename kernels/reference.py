"""Plain float64 numpy references for the kernels, written for clarity, not speed.

Each function takes any float arrays, computes in float64 and returns new float64 arrays;
nothing is updated in place (recurrent states come back as a second result).
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------------------------------------
# Norms, DeltaNet and attention (references for norms.py, deltanet.py and attention.py)
# ---------------------------------------------------------------------------------------------


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def rmsnorm_ref(x, w, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * w over the last axis (w as stored in GGUF, i.e. HF's 1 + weight)."""
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(w)


def silu_ref(x) -> np.ndarray:
    x = _f64(x)
    return x / (1.0 + np.exp(-x))


def gated_rmsnorm_ref(x, gate, w, eps: float) -> np.ndarray:
    """Qwen3-Next's gated norm: rmsnorm(x) * w * silu(gate) over the last axis."""
    return rmsnorm_ref(x, w, eps) * silu_ref(gate)


def l2norm_ref(x, eps: float = 1e-6) -> np.ndarray:
    """x * rsqrt(sum(x^2) + eps) over the last axis."""
    x = _f64(x)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv1d_ref(x, conv_state, weight) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal convolution continuing from ``conv_state``, then SiLU.

    x [n, channels]; conv_state [kernel-1, channels] (the previous kernel-1 inputs, oldest first);
    weight [channels, kernel]. Returns (silu(conv) [n, channels], new conv_state).
    """
    x, conv_state, weight = _f64(x), _f64(conv_state), _f64(weight)
    kernel = weight.shape[1]
    history = np.concatenate([conv_state, x], axis=0)
    n = x.shape[0]
    out = np.zeros_like(x)
    for t in range(n):
        # output t sees inputs t .. t+kernel-1 of the history, the last one being x[t]
        out[t] = np.sum(history[t:t + kernel].T * weight, axis=1)
    return silu_ref(out), history[history.shape[0] - (kernel - 1):].copy()


def gdn_gates_ref(alpha, b, ssm_a, dt_bias) -> tuple[np.ndarray, np.ndarray]:
    """Gated DeltaNet gates from the projections: g = ssm_a * softplus(alpha + dt_bias) (log decay,
    ssm_a = -exp(A_log) as GGUF stores it) and beta = sigmoid(b)."""
    z = _f64(alpha) + _f64(dt_bias)
    softplus = np.logaddexp(0.0, z)
    return _f64(ssm_a) * softplus, 1.0 / (1.0 + np.exp(-_f64(b)))


def gated_delta_rule_ref(q, k, v, g, beta, state, scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule, token by token.

    q, k [n, hk, dk] (already l2-normalized; q is multiplied by ``scale``, default dk**-0.5, here);
    v [n, hv, dv]; g, beta [n, hv]; state [hv, dk, dv]. Value head h reads key head h // (hv // hk).
    Per token and value head: S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T (scale q).
    Returns (out [n, hv, dv], new state).
    """
    q, k, v, g, beta = (_f64(a) for a in (q, k, v, g, beta))
    S = _f64(state).copy()
    n, hk, dk = q.shape
    hv = v.shape[1]
    group = hv // hk
    if scale is None:
        scale = dk ** -0.5
    out = np.zeros(v.shape)
    for t in range(n):
        for h in range(hv):
            kh = h // group
            S[h] *= np.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - S[h].T @ k[t, kh])
            S[h] += np.outer(k[t, kh], delta)
            out[t, h] = S[h].T @ (q[t, kh] * scale)
    return out, S


def attend_ref(q, k_cache, v_cache, start_pos: int, scale: float | None = None) -> np.ndarray:
    """Causal softmax attention of queries at positions start_pos.. over a KV cache.

    q [n, hq, d]; k_cache [T, hkv, d]; v_cache [T, hkv, dv]; query i attends cache rows 0..start_pos+i;
    query head h uses kv head h // (hq // hkv). Returns [n, hq, dv].
    """
    q, k_cache, v_cache = _f64(q), _f64(k_cache), _f64(v_cache)
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    if scale is None:
        scale = d ** -0.5
    out = np.zeros((n, hq, v_cache.shape[2]))
    for i in range(n):
        length = start_pos + i + 1
        for h in range(hq):
            scores = k_cache[:length, h // group] @ q[i, h] * scale
            p = np.exp(scores - scores.max())
            out[i, h] = (p / p.sum()) @ v_cache[:length, h // group]
    return out


def attend_selected_ref(q, k_cache, v_cache, allowed, scale: float | None = None) -> np.ndarray:
    """Softmax attention of query i over only the cache rows j with allowed[i, j]; shapes as attend_ref."""
    q, k_cache, v_cache = _f64(q), _f64(k_cache), _f64(v_cache)
    n, hq, d = q.shape
    group = hq // k_cache.shape[1]
    if scale is None:
        scale = d ** -0.5
    out = np.zeros((n, hq, v_cache.shape[2]))
    for i in range(n):
        rows = np.flatnonzero(allowed[i])
        for h in range(hq):
            scores = k_cache[rows, h // group] @ q[i, h] * scale
            p = np.exp(scores - scores.max())
            out[i, h] = (p / p.sum()) @ v_cache[rows, h // group]
    return out


def rope_ref(x, positions, theta: float, rot_dim: int) -> np.ndarray:
    """NEOX-style rotary embedding on the first rot_dim dims of x [n, h, d] (pairs i, i + rot_dim/2);
    the other dims pass unchanged."""
    x = _f64(x)
    half = rot_dim // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / rot_dim)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    out = x.copy()
    x1, x2 = x[..., :half], x[..., half:rot_dim]
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rot_dim] = x2 * cos + x1 * sin
    return out


# ---------------------------------------------------------------------------------------------
# k-quant activations (reference for quant.py's act_quant=True with the k-quant formats)
# ---------------------------------------------------------------------------------------------


def q8_k_activations_ref(x) -> np.ndarray:
    """Activations as ggml's k-quant dot products see them: quantize_row_q8_K_ref per 256 values.

    Per block: max = the first value of largest magnitude (sign kept), iscale = -127/max (float32),
    q = min(127, nearest_int(iscale * x)) with ggml's float32 magic-number rounding (ties to even),
    d = 1/iscale (float32); an all-zero block stays zero.  Returns q * d exactly, in float64, shaped as x.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % 256:
        raise ValueError(f"Q8_K rounds blocks of 256 values; last axis has {x.shape[-1]}")
    blocks = x.reshape(-1, 256)
    vmax = blocks[np.arange(blocks.shape[0]), np.argmax(np.abs(blocks), axis=1)]
    nonzero = vmax != 0
    iscale = np.where(nonzero, np.float32(-127.0) / np.where(nonzero, vmax, np.float32(1.0)), np.float32(0.0))
    # nearest_int: adding 1.5 * 2^23 leaves round(v) in the low mantissa bits of the float32 sum
    shifted = (iscale[:, None] * blocks + np.float32(12582912.0)).astype(np.float32)
    q = np.minimum(127, (shifted.view(np.int32) & 0x007FFFFF) - 0x00400000)
    d = np.where(nonzero, np.float32(1.0) / np.where(nonzero, iscale, np.float32(1.0)), np.float32(0.0))
    return (q.astype(np.float64) * d.astype(np.float64)[:, None]).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# Quantized formats (decoders for ggml types gguf-py does not implement)
# ---------------------------------------------------------------------------------------------


def dequantize_q2_0_ref(data, shape) -> np.ndarray:
    """Q2_0 (ggml type 42) to float64, shaped ``shape`` (last axis = row length, a multiple of 64).

    A block holds 64 weights in 18 bytes: the fp16 scale d, then 16 bytes of 2-bit codes with the
    low bits first, so weight j's code is (qs[j // 4] >> 2 * (j % 4)) & 3; its value is (code - 1) * d.
    """
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, 18)
    d = blocks[:, :2].copy().view("<f2").astype(np.float64)  # [n_blocks, 1]
    qs = blocks[:, 2:].astype(np.int64)
    j = np.arange(64)
    codes = (qs[:, j // 4] >> (2 * (j % 4))) & 3
    return ((codes - 1) * d).reshape(shape)
