"""Normalizations of Qwen3-Next / Qwen3-MoE: RMSNorm (whole rows or per head), the gated RMSNorm
of the DeltaNet output, and the L2 norm of DeltaNet queries and keys.

RMSNorm weights are taken as GGUF stores them: llama.cpp's converter writes HF's ``1 + weight``,
so the kernels compute ``x * rsqrt(mean(x^2) + eps) * w``. The gated norm's weight is stored
unchanged (HF multiplies by it directly). Sums of squares accumulate in float64; everything else
is float32. Rows are short (a few thousand values at most): a call runs serially, or with its rows
split over the threads where there are many (a prompt chunk).
"""

from __future__ import annotations

import numba
import numpy as np

from .activations import ELEMENTWISE_MATH, by_size, sigmoid_f32
from .checks import require_array


@numba.njit(inline="always", nogil=True)
def _sum_squares(x):
    """sum x[i]^2 in float64 over eight interleaved partial sums: one chain of dependent adds (3-4 cycles each)
    had bounded the norms of a prompt chunk (~3 ns a value)."""
    d = x.shape[0]
    m = d - d % 8
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    for i in range(0, m, 8):
        a0, a1, a2, a3 = np.float64(x[i]), np.float64(x[i + 1]), np.float64(x[i + 2]), np.float64(x[i + 3])
        a4, a5, a6, a7 = np.float64(x[i + 4]), np.float64(x[i + 5]), np.float64(x[i + 6]), np.float64(x[i + 7])
        s0 += a0 * a0
        s1 += a1 * a1
        s2 += a2 * a2
        s3 += a3 * a3
        s4 += a4 * a4
        s5 += a5 * a5
        s6 += a6 * a6
        s7 += a7 * a7
    for i in range(m, d):
        a = np.float64(x[i])
        s0 += a * a
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@numba.njit(inline="always", nogil=True)
def _rmsnorm_row(x, w, eps, out):
    inv = np.float32(1.0 / np.sqrt(_sum_squares(x) / x.shape[0] + eps))
    for i in range(x.shape[0]):
        out[i] = x[i] * inv * w[i]


@numba.njit(inline="always", nogil=True)
def _gated_rmsnorm_row(x, gate, w, eps, out):
    inv = np.float32(1.0 / np.sqrt(_sum_squares(x) / x.shape[0] + eps))
    for i in range(x.shape[0]):
        z = gate[i]
        out[i] = x[i] * inv * w[i] * (z * sigmoid_f32(z))


@numba.njit(inline="always", nogil=True)
def _l2norm_row(x, eps, out):
    inv = np.float32(1.0 / np.sqrt(_sum_squares(x) + eps))
    for i in range(x.shape[0]):
        out[i] = x[i] * inv


# Each norm as a serial and a parallel loop over the same row function (the results are the same bits).
@numba.njit(nogil=True, cache=True, fastmath=False)
def _rmsnorm_rows(x, w, eps, out):
    for r in range(x.shape[0]):
        _rmsnorm_row(x[r], w, eps, out[r])


@numba.njit(nogil=True, cache=True, fastmath=False, parallel=True)
def _rmsnorm_rows_parallel(x, w, eps, out):
    for r in numba.prange(x.shape[0]):
        _rmsnorm_row(x[r], w, eps, out[r])


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy")
def _gated_rmsnorm_rows(x, gate, w, eps, out):
    for r in range(x.shape[0]):
        _gated_rmsnorm_row(x[r], gate[r], w, eps, out[r])


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy", parallel=True)
def _gated_rmsnorm_rows_parallel(x, gate, w, eps, out):
    for r in numba.prange(x.shape[0]):
        _gated_rmsnorm_row(x[r], gate[r], w, eps, out[r])


@numba.njit(nogil=True, cache=True, fastmath=False)
def _l2norm_rows(x, eps, out):
    for r in range(x.shape[0]):
        _l2norm_row(x[r], eps, out[r])


@numba.njit(nogil=True, cache=True, fastmath=False, parallel=True)
def _l2norm_rows_parallel(x, eps, out):
    for r in numba.prange(x.shape[0]):
        _l2norm_row(x[r], eps, out[r])


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each row: x [n, d] float32, w [d] float32 (GGUF weight) -> float32 [n, d]."""
    require_array("x", x, (None, None))
    require_array("w", w, (x.shape[1],))
    out = np.empty_like(x)
    by_size(x.size, _rmsnorm_rows, _rmsnorm_rows_parallel)(x, w, float(eps), out)
    return out


def rmsnorm_heads(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each head vector (attention q/k norms): x [n, h, d], w [d] -> float32 [n, h, d]."""
    require_array("x", x, (None, None, None))
    require_array("w", w, (x.shape[2],))
    out = np.empty_like(x)
    by_size(x.size, _rmsnorm_rows, _rmsnorm_rows_parallel)(x.reshape(-1, x.shape[2]), w, float(eps),
                                                            out.reshape(-1, x.shape[2]))
    return out


def gated_rmsnorm(x: np.ndarray, gate: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Qwen3NextRMSNormGated per head: rmsnorm(x) * w * silu(gate); x, gate [n, h, d], w [d]."""
    require_array("x", x, (None, None, None))
    require_array("gate", gate, x.shape)
    require_array("w", w, (x.shape[2],))
    d = x.shape[2]
    out = np.empty_like(x)
    by_size(x.size, _gated_rmsnorm_rows, _gated_rmsnorm_rows_parallel)(x.reshape(-1, d), gate.reshape(-1, d), w,
                                                                      float(eps), out.reshape(-1, d))
    return out


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """L2 norm of each head vector (DeltaNet q/k): x * rsqrt(sum(x^2) + eps); x [n, h, d] -> float32."""
    require_array("x", x, (None, None, None))
    d = x.shape[2]
    out = np.empty_like(x)
    by_size(x.size, _l2norm_rows, _l2norm_rows_parallel)(x.reshape(-1, d), float(eps), out.reshape(-1, d))
    return out
