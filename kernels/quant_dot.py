"""Fused dot products of one ggml row with float32 activations, for the decode matrix-vector product.

Decoding a row into a scratch buffer and then taking a dot product reads and writes every weight twice
as float32; these kernels multiply the codes straight out of the blocks, with the block's scales applied
once per sub-block. Sub-block minimums (Q4_K) use per-32 sums of the activations, computed once per
vector (``block_sums32``) and shared by every row. The inner dots are the vector dots of kernels/simd.py
(sums reassociated, well inside the float64-reference tests' tolerances).

Layouts are those of quant_q8 / quant_k (ggml-common.h); the dequantizers there are the definition,
and tests compare these dots with float64 dot products of their output.
"""

import numba
import numpy as np

from .simd import fdot_q4_k_row, fdot_q5_k_row, fdot_q6_k_row, fdot_q8_0_row

_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


@numba.njit(nogil=True, cache=True, fastmath=False)
def block_sums32(x, out):
    """out[j] = sum of x[32 j : 32 j + 32]."""
    for j in range(out.shape[0]):
        s = np.float32(0.0)
        for i in range(32):
            s += x[32 * j + i]
        out[j] = s


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def dot_q8_0(src, x, xsum32):
    """sum_i w_i x_i for one Q8_0 row (blocks: fp16 d, 32 int8)."""
    return fdot_q8_0_row(src, x, x.shape[0] // 32)


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def dot_q4_k(src, x, xsum32):
    """One Q4_K row: per 32-weight sub-block, d*sc * sum(q x) - dmin*m * sum(x)."""
    return fdot_q4_k_row(src, x, xsum32, x.shape[0] // 256)


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def dot_q5_k(src, x, xsum32):
    """One Q5_K row: Q4_K's with a fifth code bit."""
    return fdot_q5_k_row(src, x, xsum32, x.shape[0] // 256)


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def dot_q6_k(src, x, xsum32):
    """One Q6_K row: 16-weight runs with int8 scales, values (6-bit code - 32)."""
    return fdot_q6_k_row(src, x, x.shape[0] // 256)
