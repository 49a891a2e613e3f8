"""Normalizations of Qwen3-Next / Qwen3-MoE: RMSNorm (whole rows or per head), the gated RMSNorm
of the DeltaNet output, and the L2 norm of DeltaNet queries and keys.

RMSNorm weights are taken as GGUF stores them: llama.cpp's converter writes HF's ``1 + weight``,
so the kernels compute ``x * rsqrt(mean(x^2) + eps) * w``. The gated norm's weight is stored
unchanged (HF multiplies by it directly). Sums of squares accumulate in float64; everything else
is float32. Rows are short (a few thousand values at most), so the kernels run serially.
"""

from __future__ import annotations

import numba
import numpy as np

from .activations import ELEMENTWISE_MATH, sigmoid_f32
from .checks import require_array


@numba.njit(nogil=True, cache=True, fastmath=False)
def _rmsnorm_rows(x, w, eps, out):
    rows, d = x.shape
    for r in range(rows):
        ss = 0.0
        for i in range(d):
            xi = np.float64(x[r, i])
            ss += xi * xi
        inv = np.float32(1.0 / np.sqrt(ss / d + eps))
        for i in range(d):
            out[r, i] = x[r, i] * inv * w[i]


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy")
def _gated_rmsnorm_rows(x, gate, w, eps, out):
    rows, d = x.shape
    for r in range(rows):
        ss = 0.0
        for i in range(d):
            xi = np.float64(x[r, i])
            ss += xi * xi
        inv = np.float32(1.0 / np.sqrt(ss / d + eps))
        for i in range(d):
            z = gate[r, i]
            out[r, i] = x[r, i] * inv * w[i] * (z * sigmoid_f32(z))


@numba.njit(nogil=True, cache=True, fastmath=False)
def _l2norm_rows(x, eps, out):
    rows, d = x.shape
    for r in range(rows):
        ss = 0.0
        for i in range(d):
            xi = np.float64(x[r, i])
            ss += xi * xi
        inv = np.float32(1.0 / np.sqrt(ss + eps))
        for i in range(d):
            out[r, i] = x[r, i] * inv


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row: x [n, d] float32, w [d] float32 (GGUF weight) -> float32 [n, d]."""
    require_array("x", x, (None, None))
    require_array("w", w, (x.shape[1],))
    out = np.empty_like(x)
    _rmsnorm_rows(x, w, float(eps), out)
    return out


def rmsnorm_heads(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each head vector (attention q/k norms): x [n, h, d], w [d] -> float32 [n, h, d]."""
    require_array("x", x, (None, None, None))
    require_array("w", w, (x.shape[2],))
    out = np.empty_like(x)
    _rmsnorm_rows(x.reshape(-1, x.shape[2]), w, float(eps), out.reshape(-1, x.shape[2]))
    return out


def gated_rmsnorm(x: np.ndarray, gate: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Qwen3NextRMSNormGated per head: rmsnorm(x) * w * silu(gate); x, gate [n, h, d], w [d]."""
    require_array("x", x, (None, None, None))
    require_array("gate", gate, x.shape)
    require_array("w", w, (x.shape[2],))
    d = x.shape[2]
    out = np.empty_like(x)
    _gated_rmsnorm_rows(x.reshape(-1, d), gate.reshape(-1, d), w, float(eps), out.reshape(-1, d))
    return out


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """L2 norm of each head vector (DeltaNet q/k): x * rsqrt(sum(x^2) + eps); x [n, h, d] -> float32."""
    require_array("x", x, (None, None, None))
    d = x.shape[2]
    out = np.empty_like(x)
    _l2norm_rows(x.reshape(-1, d), float(eps), out.reshape(-1, d))
    return out
