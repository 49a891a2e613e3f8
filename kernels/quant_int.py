"""Integer dot products with activations quantized the way ggml quantizes them (decode).

ggml multiplies a quantized weight row by activations it first rounds to int8 blocks: Q8_0 (per 32
values: an fp16 scale, 32 int8) for Q8_0 weights, Q8_K (per 256: a float32 scale, 256 int8 and the sums of
each 16) for the K-quants. The products inside a block are then exact integers and only the block's
scales are floating point. These kernels do the same: the codes of a weight block times the int8
activations, summed in vector lanes (kernels/simd.py: vpmaddwd or vpdpbusd), one float multiply per
(sub-)block. The activations take a quarter of the float32 bytes, which also relieves the caches.

Results equal the float dot product of the dequantized weights with the dequantized activations up to
float32 rounding (tests compare with float64), so this is the fast path of ``quantized_activations``.
"""

import numba
import numpy as np

from .ggml_blocks import f16, round_to_half
from .quant_dot import q4_k_scales
from .simd import idot_bits_32, idot_q6_16, idot_s8_32

_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


@numba.njit(nogil=True, cache=True)
def quantize_q8(x, block, xq, xd):
    """x float32 [k] -> int8 codes xq [k] and scales xd [k / block], ggml's rounding.

    block 32 (Q8_0): d = amax / 127 stored as fp16, q = roundf(x / d) with the unrounded d.
    block 256 (Q8_K): iscale = -127 / (the value of largest magnitude), q = min(127, nearest(iscale x)),
    d = 1 / iscale in float32. An all-zero block gets d = 0 and zero codes.
    """
    for b in range(x.shape[0] // block):
        b0 = b * block
        amax = np.float32(0.0)
        vmax = np.float32(0.0)  # the value of largest magnitude, sign kept (Q8_K scales by it)
        for i in range(b0, b0 + block):
            if abs(x[i]) > amax:
                amax = abs(x[i])
                vmax = x[i]
        if amax == 0:
            xd[b] = 0.0
            for i in range(b0, b0 + block):
                xq[i] = 0
        elif block == 32:
            d = np.float32(amax / np.float32(127.0))
            inv = np.float32(1.0) / d
            xd[b] = round_to_half(d)
            for i in range(b0, b0 + block):
                v = x[i] * inv
                q = np.floor(abs(v) + np.float32(0.5))  # roundf: halves away from zero
                xq[i] = np.int8(q if v >= 0 else -q)
        else:
            iscale = np.float32(-127.0) / vmax
            xd[b] = np.float32(1.0) / iscale
            for i in range(b0, b0 + block):
                xq[i] = np.int8(min(127.0, np.rint(iscale * x[i])))


@numba.njit(nogil=True, cache=True)
def sums16(xq, out):
    """out[j] = sum of xq[16 j : 16 j + 16] (Q8_K's bsums)."""
    for j in range(out.shape[0]):
        s = np.int32(0)
        for i in range(16):
            s += np.int32(xq[16 * j + i])
        out[j] = s


@numba.njit(inline="always", nogil=True)
def _i8(v):
    """A byte read as int8, as int32."""
    return np.int32(v) - 256 if v > 127 else np.int32(v)


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_q8_0(src, xq, xd):
    """One Q8_0 row (fp16 d, 32 int8 per block) times Q8_0 activations."""
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // 32):
        o = b * 34
        acc += f16(src, o) * xd[b] * np.float32(idot_s8_32(src, o + 2, xq, 32 * b))
    return acc


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_q4_k(src, xq, xd, xs16):
    """One Q4_K row times Q8_K activations: d * sum_j sc_j (q_j . x_j) - dmin * sum_j m_j sum(x_j), per 256."""
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // 256):
        o = b * 144
        isc = np.int32(0)
        imin = np.int32(0)
        for g in range(4):
            j = 2 * g  # sub-blocks j (low nibbles) and j + 1 (high nibbles) share 32 bytes
            sc1, m1, sc2, m2 = q4_k_scales(src, o, j)
            qs = o + 16 + 32 * g
            y = 256 * b + 64 * g
            s1 = idot_bits_32(src, qs, 0, 15, xq, y)
            s2 = idot_bits_32(src, qs, 4, 15, xq, y + 32)
            g16 = 16 * b + 4 * g  # the 16-sums of sub-blocks j and j + 1
            isc += sc1 * s1 + sc2 * s2
            imin += m1 * (xs16[g16] + xs16[g16 + 1]) + m2 * (xs16[g16 + 2] + xs16[g16 + 3])
        acc += xd[b] * (f16(src, o) * np.float32(isc) - f16(src, o + 2) * np.float32(imin))
    return acc


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_q6_k(src, xq, xd, xs16):
    """One Q6_K row times Q8_K activations: per 16-run int8 scale * sum((code - 32) x), per 256 the fp16 d.
    The -32 offset is taken out of the products with the activations' 16-sums."""
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // 256):
        o = b * 210
        isum = np.int32(0)
        for half in range(2):
            for part in range(2):
                ql = o + 64 * half + 16 * part
                qh = o + 128 + 32 * half + 16 * part
                y = 256 * b + 128 * half + 16 * part
                s0 = idot_q6_16(src, ql, 0, src, qh, 0, xq, y)
                s1 = idot_q6_16(src, ql + 32, 0, src, qh, 2, xq, y + 32)
                s2 = idot_q6_16(src, ql, 4, src, qh, 4, xq, y + 64)
                s3 = idot_q6_16(src, ql + 32, 4, src, qh, 6, xq, y + 96)
                sc = o + 192 + 8 * half + part
                g = y // 16
                isum += (_i8(src[sc]) * (s0 - 32 * xs16[g]) + _i8(src[sc + 2]) * (s1 - 32 * xs16[g + 2])
                         + _i8(src[sc + 4]) * (s2 - 32 * xs16[g + 4]) + _i8(src[sc + 6]) * (s3 - 32 * xs16[g + 6]))
        acc += f16(src, o + 208) * xd[b] * np.float32(isum)
    return acc
