"""Fused dot products of one ggml row with float32 activations, for the decode matrix-vector product.

Decoding a row into a scratch buffer and then taking a dot product reads and writes every weight twice
as float32; these kernels multiply the codes straight out of the blocks, with the block's scales applied
once per sub-block. Sub-block minimums (Q4_K) use per-32 sums of the activations, computed once per
vector (``block_sums32``) and shared by every row. Inner loops are plain loops over 16 or 32 bytes that
LLVM vectorizes (fastmath: the sums are reassociated, as in the float64-reference tests' tolerances).

Layouts are those of quant_q8 / quant_k (ggml-common.h); the dequantizers there are the definition,
and tests compare these dots with float64 dot products of their output.
"""

import numba
import numpy as np

from .ggml_blocks import f16

_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


@numba.njit(nogil=True, cache=True)
def block_sums32(x, out):
    """out[j] = sum of x[32 j : 32 j + 32]."""
    for j in range(out.shape[0]):
        s = np.float32(0.0)
        for i in range(32):
            s += x[32 * j + i]
        out[j] = s


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def dot_q8_0(src, x):
    """sum_i w_i x_i for one Q8_0 row (blocks: fp16 d, 32 int8)."""
    acc = np.float32(0.0)
    for b in range(x.shape[0] // 32):
        o = b * 34
        s = np.float32(0.0)
        for i in range(32):
            s += np.float32(np.int8(src[o + 2 + i])) * x[32 * b + i]  # the byte reinterpreted as int8
        acc += f16(src, o) * s
    return acc


@numba.njit(inline="always", nogil=True)
def q4_k_scales(src, o, j):
    """The 6-bit scales and mins of Q4_K sub-blocks j and j + 1 (j even) of the block at byte o."""
    if j < 4:
        return (np.int32(src[o + 4 + j] & 63), np.int32(src[o + 8 + j] & 63),
                np.int32(src[o + 5 + j] & 63), np.int32(src[o + 9 + j] & 63))
    return (np.int32((src[o + 8 + j] & 0xF) | ((src[o + j] >> 6) << 4)),
            np.int32((src[o + 8 + j] >> 4) | ((src[o + 4 + j] >> 6) << 4)),
            np.int32((src[o + 9 + j] & 0xF) | ((src[o + 1 + j] >> 6) << 4)),
            np.int32((src[o + 9 + j] >> 4) | ((src[o + 5 + j] >> 6) << 4)))


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def dot_q4_k(src, x, xsum32):
    """One Q4_K row: per 32-weight sub-block, d*sc * sum(q x) - dmin*m * sum(x)."""
    acc = np.float32(0.0)
    for b in range(x.shape[0] // 256):
        o = b * 144
        d = f16(src, o)
        dmin = f16(src, o + 2)
        for g in range(4):
            j = 2 * g  # sub-blocks j (low nibbles) and j + 1 (high nibbles) share 32 bytes
            sc1, m1, sc2, m2 = q4_k_scales(src, o, j)
            qs = o + 16 + 32 * g
            y = 256 * b + 64 * g
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            for l in range(32):
                v = src[qs + l]
                s1 += np.float32(v & 0xF) * x[y + l]
                s2 += np.float32(v >> 4) * x[y + 32 + l]
            sb = 8 * b + j
            acc += d * (np.float32(sc1) * s1 + np.float32(sc2) * s2) \
                - dmin * (np.float32(m1) * xsum32[sb] + np.float32(m2) * xsum32[sb + 1])
    return acc


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def dot_q6_k(src, x):
    """One Q6_K row: 16-weight runs with int8 scales, values (6-bit code - 32)."""
    acc = np.float32(0.0)
    for b in range(x.shape[0] // 256):
        o = b * 210
        blk = np.float32(0.0)
        for half in range(2):
            for part in range(2):
                ql = o + 64 * half + 16 * part
                qh = o + 128 + 32 * half + 16 * part
                y = 256 * b + 128 * half + 16 * part
                s0 = np.float32(0.0)
                s1 = np.float32(0.0)
                s2 = np.float32(0.0)
                s3 = np.float32(0.0)
                for l in range(16):
                    a = np.int32(src[ql + l])
                    c = np.int32(src[ql + 32 + l])
                    h = np.int32(src[qh + l])
                    s0 += np.float32(((a & 0xF) | ((h & 3) << 4)) - 32) * x[y + l]
                    s1 += np.float32(((c & 0xF) | ((h & 12) << 2)) - 32) * x[y + 32 + l]
                    s2 += np.float32(((a >> 4) | (h & 48)) - 32) * x[y + 64 + l]
                    s3 += np.float32(((c >> 4) | ((h & 192) >> 2)) - 32) * x[y + 96 + l]
                sc = o + 192 + 8 * half + part
                blk += _i8f(src[sc]) * s0 + _i8f(src[sc + 2]) * s1 + _i8f(src[sc + 4]) * s2 + _i8f(src[sc + 6]) * s3
        acc += f16(src, o + 208) * blk
    return acc


@numba.njit(inline="always", nogil=True)
def _i8f(v):
    """A byte read as int8, as float32."""
    return np.float32(np.int32(v) - 256 if v > 127 else np.int32(v))
