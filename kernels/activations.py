"""Element-wise activations: sigmoid, SiLU, SwiGLU's silu(gate) * up and the output gate x * sigmoid(gate).

One pass over the data each, with an exp that vectorizes: Numba lowers np.exp to a libm call per value, which
LLVM cannot vectorize without a vector math library, and numpy's sigmoid took six passes over memory; on a
512-token prompt chunk the activations had cost ~15 ns per value. ``exp_nonpositive`` is Cephes' expf (a
degree-7 polynomial on the reduced argument, within 1 ulp of the float64 exp; tests/test_kernels_activations.py
measures it) for the arguments these functions take: -|x|, never positive, so it never overflows. Below -87 the
true value is subnormal (< 1.7e-38) and the result is 0.
"""

from __future__ import annotations

import numba
import numpy as np

from .simd import f32_from_bits


# Fused multiply-adds, but no reassociation: the two-part ln 2 reduction must stay in order to be exact. Kernels
# that inline sigmoid_f32 take these flags and error_model="numpy" too (no ZeroDivisionError check: it is what
# lets LLVM vectorize the divisions).
ELEMENTWISE_MATH = {"nsz", "contract"}
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # ln 2 in two parts: n * _LN2_HI is exact for |n| <= 127
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.0)  # exp(-87) = 1.6e-38, just above float32's smallest normal number


# From this many values the row-wise kernels (norms, rotary embedding, the DeltaNet convolution) split their rows over
# the threads: a prompt chunk (512 tokens x 2048). A decoded token's few rows stay on the calling thread, where
# starting the thread pool would cost more than the work.
PARALLEL_VALUES = 1 << 16


def by_size(n_values: int, serial, parallel):
    """Of a kernel's serial and parallel forms (the same row function, the same bits), the one for a call over
    n_values values."""
    return parallel if n_values >= PARALLEL_VALUES else serial


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy", inline="always")
def exp_nonpositive(x):
    """exp(x) for float32 x <= 0 (0 below -87; NaN stays NaN)."""
    xc = max(x, _EXP_MIN)
    n = np.floor(xc * _LOG2E + np.float32(0.5))
    r = xc - n * _LN2_HI - n * _LN2_LO
    z = r * r
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    e = (p * z + r + np.float32(1.0)) * f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
    return np.float32(0.0) if x < _EXP_MIN else e


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy", inline="always")
def sigmoid_f32(x):
    """1 / (1 + exp(-x)) from e = exp(-|x|), which never overflows (e / (1 + e) for x < 0)."""
    e = exp_nonpositive(-abs(x))
    return (e if x < 0 else np.float32(1.0)) / (np.float32(1.0) + e)


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy")
def _sigmoid(x, out):
    for i in range(x.shape[0]):
        out[i] = sigmoid_f32(x[i])


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy")
def _silu(x, out):
    for i in range(x.shape[0]):
        out[i] = x[i] * sigmoid_f32(x[i])


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy")
def _silu_mul(gate, up, out):
    for i in range(gate.shape[0]):
        out[i] = gate[i] * sigmoid_f32(gate[i]) * up[i]


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy")
def _mul_sigmoid(x, gate, out):
    for i in range(x.shape[0]):
        out[i] = x[i] * sigmoid_f32(gate[i])


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy")
def swiglu_block(gv, uv, h, p0, r0, pairs, rows):
    """h[p0 + p, r0 + r] = silu(gv[p, r]) * uv[p, r] for p < pairs, r < rows: a block of the grouped prompt
    experts (tokens x rows of gate and up products). Compiled on its own, not inlined: inlined it took its
    callers' flags, under which only libm's exp compiled, one call per value (one layer's grouped gate/up of a
    512-token prompt, 512 experts x ~10 tokens: 2.6 M values); here the row of 16 runs in vector lanes."""
    for p in range(pairs):
        g, u, o = gv[p], uv[p], h[p0 + p]
        for r in range(rows):
            o[r0 + r] = g[r] * sigmoid_f32(g[r]) * u[r]


def _flat(name: str, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise ValueError(f"{name} must be float32, got {a.dtype}")
    return np.ascontiguousarray(a).reshape(-1)


def _same_shape(a: np.ndarray, b: np.ndarray) -> None:
    if a.shape != b.shape:
        raise ValueError(f"element-wise operands differ in shape: {a.shape} and {b.shape}")


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), float32, any shape."""
    out = np.empty(np.shape(x), np.float32)
    _sigmoid(_flat("x", x), out.reshape(-1))
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), float32, any shape."""
    out = np.empty(np.shape(x), np.float32)
    _silu(_flat("x", x), out.reshape(-1))
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up (SwiGLU's hidden activation), float32, same shapes."""
    _same_shape(np.asarray(gate), np.asarray(up))
    out = np.empty(np.shape(gate), np.float32)
    _silu_mul(_flat("gate", gate), _flat("up", up), out.reshape(-1))
    return out


def mul_sigmoid(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """x * sigmoid(gate) (an output gate), float32, same shapes."""
    _same_shape(np.asarray(x), np.asarray(gate))
    out = np.empty(np.shape(x), np.float32)
    _mul_sigmoid(_flat("x", x), _flat("gate", gate), out.reshape(-1))
    return out
