"""Integer dot products with activations quantized the way ggml quantizes them (decode).

ggml multiplies a quantized weight row by activations it first rounds to int8 blocks: Q8_0 (per 32
values: an fp16 scale, 32 int8) for Q8_0 weights, Q8_K (per 256: a float32 scale, 256 int8 and the sums of
each 16) for the K-quants. The products inside a block are then exact integers and only the block's
scales are floating point. These kernels do the same: the codes of a weight block times the int8
activations, summed in vector lanes (kernels/simd.py: vpmaddwd), one float multiply per
(sub-)block. The activations take a quarter of the float32 bytes, which also relieves the caches.

Results equal the float dot product of the dequantized weights with the dequantized activations up to
float32 rounding (tests compare with float64), so this is the fast path of ``quantized_activations``.
"""

import numba
import numpy as np

from .ggml_blocks import e8m0_half, f16, q3_scale, round_to_half, scale_min_k4, u16, u32
from .simd import (FP4_LEVELS, HAS_AVX512BW, HAS_F16C, HAS_GFNI, HAS_VNNI, IQ4_LEVELS, fdot_iq4_nl_pairs,
                   fdot_iq4_xs_blocks, fdot_mxfp4_pairs, fdot_q2_0_blocks, fdot_q2_k_blocks, fdot_q3_k_blocks,
                   fdot_q4_0_pairs, fdot_q4_1_pairs, fdot_q4_k_blocks, fdot_q5_0_pairs, fdot_q5_1_pairs,
                   fdot_q5_k_blocks, fdot_q6_k_blocks, fdot_q8_0_octets, fdot_q8_0_pairs, idot_q2_0_block,
                   idot_q2_k_block, idot_q4_k_block, idot_q6_half, idot_s8_32)

_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=False)
def quantize_q8(x, block, xq, xd):
    """x float32 [k] -> int8 codes xq [k] and scales xd [k / block], ggml's rounding.

    block 32 (Q8_0): d = amax / 127 stored as fp16, q = roundf(x / d) with the unrounded d.
    block 256 (Q8_K): iscale = -127 / (the value of largest magnitude), q = min(127, nearest(iscale x)),
    d = 1 / iscale in float32. An all-zero block gets d = 0 and zero codes.
    The loops are branch-free over one block's slices so that they vectorize (~10x faster than with a branch
    per value): the largest magnitude is the largest of the values' bit patterns without their sign (the same
    order, for numbers), then the first value holding it is the smallest index among those that hold it (a
    vectorized minimum: a scan with an early exit had cost a third of the Q8_K rounding, 0.78 -> 0.60 ns a value
    with the code sums, and of Q8_0's 1.62 -> 1.05).
    """
    bits = x.view(np.int32)  # once: a view per block costs more than the block's work
    for b in range(x.shape[0] // block):
        xs = x[b * block:(b + 1) * block]
        qs = xq[b * block:(b + 1) * block]
        mag = bits[b * block:(b + 1) * block]
        mbits = np.int32(0)
        for i in range(block):
            mbits = max(mbits, mag[i] & np.int32(0x7FFFFFFF))
        first = block  # the index of the first value of largest magnitude (Q8_K scales by it, sign kept)
        for i in range(block):
            first = min(first, i if mag[i] & np.int32(0x7FFFFFFF) == mbits else block)
        vmax = xs[first]
        amax = abs(vmax)
        if amax == 0:
            xd[b] = 0.0
            qs[:] = 0
        elif block == 32:
            d = np.float32(amax / np.float32(127.0))
            inv = np.float32(1.0) / d
            xd[b] = round_to_half(d)
            for i in range(block):
                v = xs[i] * inv
                # roundf (halves away from zero), exactly: floor(|v| + 0.5) would round 0.49999997 up, since
                # the sum rounds to 1.0 in float32; the fraction |v| - floor(|v|) is exact.
                a = abs(v)
                q = np.floor(a)
                q = q + np.float32(1.0) if a - q >= np.float32(0.5) else q
                qs[i] = np.int8(q if v >= 0 else -q)
        else:
            iscale = np.float32(-127.0) / vmax
            xd[b] = np.float32(1.0) / iscale
            for i in range(block):
                v = np.rint(iscale * xs[i])
                qs[i] = np.int8(v if v < np.float32(127.0) else np.float32(127.0))


@numba.njit(nogil=True, cache=True, fastmath=False)
def round_q8_rows(x, block, out):
    """Each row of x [n, k] rounded as quantize_q8 rounds it, written to out [n, k] as codes times block scales
    (float32 products, as numpy's int8 * float32): the activations ggml's integer dots see, for the float
    products of prompts. On the calling thread: it runs just before a matrix product, and the workers of a
    parallel region, spinning idle afterwards, would take the cores from the product's tile threads (measured:
    the products slowed by more than the rounding gained)."""
    n, k = x.shape
    xq = np.empty(k, np.int8)
    xd = np.empty(k // block, np.float32)
    for r in range(n):
        quantize_q8(x[r], block, xq, xd)
        o = out[r]
        for b in range(k // block):
            d = xd[b]
            for i in range(b * block, (b + 1) * block):
                o[i] = np.float32(xq[i]) * d


@numba.njit(nogil=True, cache=True, fastmath=False)
def sums16(xq, out):
    """out[j] = sum of xq[16 j : 16 j + 16] (Q8_K's bsums)."""
    for j in range(out.shape[0]):
        s = np.int32(0)
        for i in range(16):
            s += np.int32(xq[16 * j + i])
        out[j] = s


@numba.njit(nogil=True, cache=True, fastmath=False)
def quantize_q8_sums(x, block, xq, xd, xs16):
    """quantize_q8 then sums16 of the codes: what the integer dots take."""
    quantize_q8(x, block, xq, xd)
    sums16(xq, xs16)


@numba.njit(inline="always", nogil=True)
def q8_activations(x, block):
    """x's int8 codes, block scales and code 16-sums in new arrays (quantize_q8_sums)."""
    xq = np.empty(x.shape[0], np.int8)
    xd = np.empty(x.shape[0] // block, np.float32)
    xs16 = np.empty(x.shape[0] // 16, np.int32)
    quantize_q8_sums(x, block, xq, xd, xs16)
    return xq, xd, xs16


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_q8_0(src, xq, xd, xs16):
    """One Q8_0 row (fp16 d, 32 int8 per block) times Q8_0 activations."""
    acc = np.float32(0.0)
    first = 0
    if HAS_VNNI and HAS_F16C:  # eight blocks a step (1.25x the pairs in cache on a Xeon), then the rest one by one
        first = xq.shape[0] // 256 * 8
        acc = fdot_q8_0_octets(src, xq, xd, xs16, first // 8)
    elif HAS_AVX512BW and HAS_F16C:  # pairs of blocks in vector lanes, then the odd block if any
        first = xq.shape[0] // 64 * 2
        acc = fdot_q8_0_pairs(src, xq, xd, first // 2)
    for b in range(first, xq.shape[0] // 32):
        o = b * 34
        acc += f16(src, o) * xd[b] * np.float32(idot_s8_32(src, o + 2, xq, 32 * b))
    return acc


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_q4_k(src, xq, xd, xs16):
    """One Q4_K row times Q8_K activations: d * sum_j sc_j (q_j . x_j) - dmin * sum_j m_j sum(x_j), per 256."""
    if HAS_AVX512BW and HAS_F16C:
        return fdot_q4_k_blocks(src, xq, xd, xs16, xq.shape[0] // 256)
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // 256):
        o = b * 144
        acc += xd[b] * idot_q4_k_block(src, o, xq, 256 * b, xs16, 16 * b, f16(src, o), f16(src, o + 2))
    return acc


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH)
def idot_q5_k_loop(src, xq, xd, xs16):
    """idot_q5_k without GFNI: each sub-block's 5-bit codes (nibble, plus 16 times bit j of qh byte l % 32 for
    sub-block j) times its 32 activation codes in integers, then d * sum_j sc_j (q_j . x_j) - dmin * sum_j m_j
    sum(x_j) per 256, as ggml's vec_dot_q5_K_q8_K."""
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // 256):
        o = b * 176
        isc = 0
        imin = 0
        for j in range(8):
            sc, m = scale_min_k4(src, o + 4, j)
            q0, y = o + 48 + 32 * (j // 2), 256 * b + 32 * j
            s = 0
            for i in range(32):
                code = ((np.int32(src[q0 + i]) >> (4 * (j % 2))) & 15) | (((np.int32(src[o + 16 + i]) >> j) & 1) << 4)
                s += code * np.int32(xq[y + i])
            isc += sc * s
            imin += m * (xs16[16 * b + 2 * j] + xs16[16 * b + 2 * j + 1])
        acc += xd[b] * (f16(src, o) * np.float32(isc) - f16(src, o + 2) * np.float32(imin))
    return acc


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_q5_k(src, xq, xd, xs16):
    """One Q5_K row times Q8_K activations: Q4_K's dot with a fifth code bit (fdot_q5_k_blocks with GFNI)."""
    if HAS_GFNI and HAS_F16C:
        return fdot_q5_k_blocks(src, xq, xd, xs16, xq.shape[0] // 256)
    return idot_q5_k_loop(src, xq, xd, xs16)


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH)
def idot_q3_k_loop(src, xq, xd, xs16):
    """idot_q3_k without AVX-512BW: per run r of 16 the signed scale s_r times (c . x_r - 4 sum(x_r)), c the 3-bit
    codes (the 2-bit code at shift 2 j of qs byte 32 n + l, plus 4 times bit 4 n + j of hm byte l, for the run's
    values 128 n + 32 j + l), per 256 d times xd, as ggml's vec_dot_q3_K_q8_K."""
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // 256):
        o = b * 110
        isum = 0
        for r in range(16):
            n, j, l0 = r // 8, (r % 8) // 2, 16 * (r % 2)
            s = 0
            for i in range(l0, l0 + 16):
                low = (np.int32(src[o + 32 + 32 * n + i]) >> (2 * j)) & 3
                high = (np.int32(src[o + i]) >> (4 * n + j)) & 1
                s += (low | (high << 2)) * np.int32(xq[256 * b + 128 * n + 32 * j + i])
            isum += q3_scale(src, o + 96, r) * (s - 4 * xs16[16 * b + r])
        acc += xd[b] * f16(src, o + 108) * np.float32(isum)
    return acc


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_q3_k(src, xq, xd, xs16):
    """One Q3_K row times Q8_K activations: the Q2_K dot's layout with a third code bit and signed scales
    (fdot_q3_k_blocks with AVX-512BW)."""
    if HAS_AVX512BW and HAS_F16C:
        return fdot_q3_k_blocks(src, xq, xd, xs16, xq.shape[0] // 256)
    return idot_q3_k_loop(src, xq, xd, xs16)


# Each 4-bit code's value as an integer: IQ4_NL's levels, MXFP4's doubled e2m1 values, Q4_0's code - 8, and
# Q4_1's code (its value is d code + m)
_IQ4_LEVELS = np.array(IQ4_LEVELS, np.int32)
_FP4_LEVELS = np.array(FP4_LEVELS, np.int32)
_Q4_0_LEVELS = np.arange(-8, 8, dtype=np.int32)
_Q4_1_LEVELS = np.arange(16, dtype=np.int32)


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _levels_dot(levels, src, q0, xq, y):
    """The 16 code bytes at src[q0] (byte j's low nibble value j, its high nibble value j + 16: a 32-value block
    or an IQ4_XS sub-block) through levels, times the int8 activation codes xq[y:y + 32], in integers."""
    s = 0
    for j in range(16):
        q = np.int32(src[q0 + j])
        s += levels[q & 15] * np.int32(xq[y + j]) + levels[q >> 4] * np.int32(xq[y + j + 16])
    return s


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _codes5_dot(src, qh, q0, xq, y, offset):
    """A 5-bit-code block (the fifth bits a 32-bit word at src[qh], value j's at bit j; byte j at src[q0 + j] holds
    value j's low four bits in its low nibble and value j + 16's in its high one: Q5_0, Q5_1) times the int8
    activation codes xq[y:y + 32]: sum (code - offset) x, in integers."""
    bits = np.int64(u32(src, qh))
    s = 0
    for j in range(16):
        q = np.int64(src[q0 + j])
        s += (((q & 15) | (((bits >> j) & 1) << 4)) - offset) * np.int64(xq[y + j])
        s += (((q >> 4) | (((bits >> (j + 16)) & 1) << 4)) - offset) * np.int64(xq[y + j + 16])
    return s


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH)
def idot_iq4_xs_loop(src, xq, xd, xs16):
    """idot_iq4_xs without VNNI: per sub-block ib of 32 its scale ls - 32 (low nibble from scales_l, top bits from
    scales_h) times the levels of its codes (value l < 16 the low nibble of byte l, l >= 16 the high nibble of
    byte l - 16) dotted with the activation codes, in integers; per 256 d times xd (ggml's vec_dot_iq4_xs_q8_K)."""
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // 256):
        o = b * 136
        scales_h = np.int32(u16(src, o + 2))
        isum = 0
        for ib in range(8):
            ls = ((np.int32(src[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((scales_h >> (2 * ib)) & 3) << 4)
            isum += (ls - 32) * _levels_dot(_IQ4_LEVELS, src, o + 8 + 16 * ib, xq, 256 * b + 32 * ib)
        acc += xd[b] * f16(src, o) * np.float32(isum)
    return acc


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_iq4_xs(src, xq, xd, xs16):
    """One IQ4_XS row times Q8_K activations (fdot_iq4_xs_blocks with VNNI)."""
    if HAS_VNNI and HAS_F16C:
        return fdot_iq4_xs_blocks(src, xq, xd, xq.shape[0] // 256)
    return idot_iq4_xs_loop(src, xq, xd, xs16)


def _pairs_then_blocks(pairs, block):
    """An integer row dot (src, xq, xd, xs16) of a 32-value format with Q8_0 activations: pairs of blocks by
    pairs(src, xq, xd, n_pairs) (simd._pair_dots' integer dot, VNNI), then the rest (an odd last block, or all of
    them without VNNI) by block(src, b, xq, xd, xs16), block b's xd d (values . x) [+ xd m sum x]."""
    @numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
    def dot(src, xq, xd, xs16):
        acc = np.float32(0.0)
        first = 0
        if HAS_VNNI and HAS_F16C:
            first = xq.shape[0] // 64 * 2
            acc = pairs(src, xq, xd, first // 2)
        for b in range(first, xq.shape[0] // 32):
            acc += block(src, b, xq, xd, xs16)
        return acc
    return dot


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _iq4_nl_block(src, b, xq, xd, xs16):
    """IQ4_NL block b (18 bytes: fp16 d, 16 code bytes) times Q8_0 activations (ggml's vec_dot_iq4_nl_q8_0)."""
    return f16(src, 18 * b) * xd[b] * np.float32(_levels_dot(_IQ4_LEVELS, src, 18 * b + 2, xq, 32 * b))


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _mxfp4_block(src, b, xq, xd, xs16):
    """MXFP4 block b (17 bytes: e8m0 exponent, 16 code bytes) times Q8_0 activations: the doubled e2m1 values and
    the halved power-of-two scale (ggml's vec_dot_mxfp4_q8_0)."""
    o = 17 * b
    return e8m0_half(np.int64(src[o])) * xd[b] * np.float32(_levels_dot(_FP4_LEVELS, src, o + 1, xq, 32 * b))


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _q4_0_block(src, b, xq, xd, xs16):
    """Q4_0 block b (18 bytes: fp16 d, 16 code bytes; value d (code - 8)) times Q8_0 activations."""
    return f16(src, 18 * b) * xd[b] * np.float32(_levels_dot(_Q4_0_LEVELS, src, 18 * b + 2, xq, 32 * b))


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _q4_1_block(src, b, xq, xd, xs16):
    """Q4_1 block b (20 bytes: fp16 d and m, 16 code bytes; value d code + m) times Q8_0 activations: xd (d codes . x
    + m sum x), sum x from the codes' 16-sums (ggml's vec_dot_q4_1_q8_1, whose Q8_1 block carries that sum)."""
    o = 20 * b
    isum = np.float32(_levels_dot(_Q4_1_LEVELS, src, o + 4, xq, 32 * b))
    return xd[b] * (f16(src, o) * isum + f16(src, o + 2) * np.float32(xs16[2 * b] + xs16[2 * b + 1]))


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _q5_0_block(src, b, xq, xd, xs16):
    """Q5_0 block b (22 bytes: fp16 d, fifth bits, 16 code bytes; value d (code - 16)) times Q8_0 activations."""
    o = 22 * b
    return f16(src, o) * xd[b] * np.float32(_codes5_dot(src, o + 2, o + 6, xq, 32 * b, 16))


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _q5_1_block(src, b, xq, xd, xs16):
    """Q5_1 block b (24 bytes: fp16 d and m, fifth bits, 16 code bytes; value d code + m) times Q8_0 activations,
    the min as in _q4_1_block."""
    o = 24 * b
    isum = np.float32(_codes5_dot(src, o + 4, o + 8, xq, 32 * b, 0))
    return xd[b] * (f16(src, o) * isum + f16(src, o + 2) * np.float32(xs16[2 * b] + xs16[2 * b + 1]))


# One row of each 32-value type times Q8_0 activations
idot_iq4_nl = _pairs_then_blocks(fdot_iq4_nl_pairs, _iq4_nl_block)
idot_mxfp4 = _pairs_then_blocks(fdot_mxfp4_pairs, _mxfp4_block)
idot_q4_0 = _pairs_then_blocks(fdot_q4_0_pairs, _q4_0_block)
idot_q4_1 = _pairs_then_blocks(fdot_q4_1_pairs, _q4_1_block)
idot_q5_0 = _pairs_then_blocks(fdot_q5_0_pairs, _q5_0_block)
idot_q5_1 = _pairs_then_blocks(fdot_q5_1_pairs, _q5_1_block)


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_q6_k(src, xq, xd, xs16):
    """One Q6_K row times Q8_K activations: per 16-run int8 scale * sum((code - 32) x), per 256 the fp16 d."""
    if HAS_AVX512BW and HAS_F16C:
        return fdot_q6_k_blocks(src, xq, xd, xs16, xq.shape[0] // 256)
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // 256):
        o = b * 210
        isum = np.int32(0)
        for half in range(2):
            y = 256 * b + 128 * half
            sc = o + 192 + 8 * half
            isum += idot_q6_half(src, o + 64 * half, o + 128 + 32 * half, sc, xq, y)
        acc += f16(src, o + 208) * xd[b] * np.float32(isum)
    return acc


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_q2_k(src, xq, xd, xs16):
    """One Q2_K row times Q8_K activations (ggml's vec_dot_q2_K_q8_K): per 16-run the 4-bit scale times the
    codes' dot minus the 4-bit min times the run's activation sum, per 256 d and dmin times xd."""
    if HAS_AVX512BW and HAS_F16C:
        return fdot_q2_k_blocks(src, xq, xd, xs16, xq.shape[0] // 256)
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // 256):
        o = b * 84
        acc += xd[b] * idot_q2_k_block(src, o, xq, 256 * b, xs16, 16 * b, f16(src, o + 80), f16(src, o + 82))
    return acc


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def idot_q2_0(src, xq, xd, xs16):
    """One Q2_0 row (per 64 values: fp16 d, 2-bit codes, value (code - 1) d) times Q8_0 activations (two
    activation blocks per weight block): d * (xd[2b] * isum_lo + xd[2b + 1] * isum_hi)."""
    if HAS_AVX512BW and HAS_F16C:
        return fdot_q2_0_blocks(src, xq, xd, xs16, xq.shape[0] // 64)
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // 64):
        o = b * 18
        lo, hi = idot_q2_0_block(src, o, xq, 64 * b, xs16, 4 * b)
        acc += f16(src, o) * (xd[2 * b] * np.float32(lo) + xd[2 * b + 1] * np.float32(hi))
    return acc
