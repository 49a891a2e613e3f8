"""ggml's scalar-scale block formats: Q4_0, Q4_1, Q5_0, Q5_1 (32 weights a block) and Q2_0 (64).

Layouts (ggml-common.h), every scale an fp16:
  Q4_0  d, qs[16]              value = (nibble - 8) * d
  Q4_1  d, m, qs[16]           value = nibble * d + m
  Q5_0  d, qh[4], qs[16]       value = ((nibble | bit << 4) - 16) * d
  Q5_1  d, m, qh[4], qs[16]    value = (nibble | bit << 4) * d + m
  Q2_0  d, qs[16]              value = (code - 1) * d, code j = (qs[j // 4] >> 2 * (j % 4)) & 3
In the 32-weight formats byte j holds weight j in its low nibble and weight j + 16 in its high one;
bit i of the little-endian uint32 qh is the fifth bit of weight i.

Activation rounding: Q4_0, Q5_0 and Q2_0 dot with Q8_0 activations, Q4_1 and Q5_1 with Q8_1. Q8_1
rounds the values exactly as Q8_0 does (same d = amax / 127 kept as fp16, same roundf) and only adds
a per-block fp16 sum used for the min term, so all five use the 32-value activation rounding.
"""

import numba
import numpy as np

from .ggml_blocks import f16, round_to_half, u32
from .quant import register_type
from .simd import HAS_AVX512BW, fdot_q2_0_row, fdot_q4_0_row, fdot_q4_1_row, fdot_q5_0_row, fdot_q5_1_row

Q4_0, Q4_1, Q5_0, Q5_1, Q2_0 = 2, 3, 6, 7, 42

_QK = 32  # weights per block in Q4_0/Q4_1/Q5_0/Q5_1
_QK2 = 64  # weights per block in Q2_0
_Q4_0_BYTES, _Q4_1_BYTES, _Q5_0_BYTES, _Q5_1_BYTES, _Q2_0_BYTES = 18, 20, 22, 24, 18


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q4_0(src, dst):
    for b in range(dst.shape[0] // _QK):
        o = b * _Q4_0_BYTES
        d = f16(src, o)
        y = b * _QK
        for j in range(16):
            q = np.int32(src[o + 2 + j])
            dst[y + j] = np.float32((q & 0xF) - 8) * d
            dst[y + j + 16] = np.float32((q >> 4) - 8) * d


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q4_1(src, dst):
    for b in range(dst.shape[0] // _QK):
        o = b * _Q4_1_BYTES
        d = f16(src, o)
        m = f16(src, o + 2)
        y = b * _QK
        for j in range(16):
            q = np.int32(src[o + 4 + j])
            dst[y + j] = np.float32(q & 0xF) * d + m
            dst[y + j + 16] = np.float32(q >> 4) * d + m


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q5_0(src, dst):
    for b in range(dst.shape[0] // _QK):
        o = b * _Q5_0_BYTES
        d = f16(src, o)
        qh = np.int64(u32(src, o + 2))
        y = b * _QK
        for j in range(16):
            q = np.int64(src[o + 6 + j])
            lo = (q & 0xF) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            dst[y + j] = np.float32(lo - 16) * d
            dst[y + j + 16] = np.float32(hi - 16) * d


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q5_1(src, dst):
    for b in range(dst.shape[0] // _QK):
        o = b * _Q5_1_BYTES
        d = f16(src, o)
        m = f16(src, o + 2)
        qh = np.int64(u32(src, o + 4))
        y = b * _QK
        for j in range(16):
            q = np.int64(src[o + 8 + j])
            lo = (q & 0xF) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            dst[y + j] = np.float32(lo) * d + m
            dst[y + j + 16] = np.float32(hi) * d + m


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q2_0(src, dst):
    for b in range(dst.shape[0] // _QK2):
        o = b * _Q2_0_BYTES
        d = f16(src, o)
        y = b * _QK2
        for i in range(16):
            q = np.int32(src[o + 2 + i])
            for s in range(4):
                dst[y + 4 * i + s] = np.float32(((q >> (2 * s)) & 3) - 1) * d


_DOT_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


@numba.njit(inline="always", nogil=True, fastmath=_DOT_FASTMATH)
def _nibbles_fdot(src, q0, x, y, offset):
    """The 16 code bytes at src[q0] (byte j's low nibble value j, its high nibble value j + 16) times float32
    x[y:y + 32]: sum (code - offset) x."""
    s = np.float32(0.0)
    for j in range(16):
        q = np.int32(src[q0 + j])
        s += np.float32((q & 0xF) - offset) * x[y + j] + np.float32((q >> 4) - offset) * x[y + j + 16]
    return s


@numba.njit(inline="always", nogil=True, fastmath=_DOT_FASTMATH)
def _codes5_fdot(src, qh, q0, x, y, offset):
    """A 5-bit-code block (fifth bits the 32-bit word at src[qh], codes' low bits at src[q0], as in
    _nibbles_fdot) times float32 x[y:y + 32]: sum (code - offset) x."""
    bits = np.int64(u32(src, qh))
    s = np.float32(0.0)
    for j in range(16):
        q = np.int64(src[q0 + j])
        s += np.float32(((q & 0xF) | (((bits >> j) & 1) << 4)) - offset) * x[y + j]
        s += np.float32(((q >> 4) | (((bits >> (j + 16)) & 1) << 4)) - offset) * x[y + j + 16]
    return s


def pairs_then_blocks(pairs, block):
    """A float row dot (src, x, xsum32) of a 32-value format: pairs of blocks straight from the bytes by
    pairs(src, x, xsum32, n_pairs) (simd._pair_dots' float dot, AVX-512BW), then the rest (an odd last block, or
    all of them without AVX-512BW) by block(src, b, x, xsum32), block b's d (values . x) [+ m xsum32[b]]."""
    @numba.njit(inline="always", nogil=True, fastmath=_DOT_FASTMATH)
    def dot(src, x, xsum32):
        acc = np.float32(0.0)
        first = 0
        if HAS_AVX512BW:
            first = x.shape[0] // 64 * 2
            acc = pairs(src, x, xsum32, first // 2)
        for b in range(first, x.shape[0] // _QK):
            acc += block(src, b, x, xsum32)
        return acc
    return dot


@numba.njit(inline="always", nogil=True, fastmath=_DOT_FASTMATH)
def _q4_0_block(src, b, x, xsum32):
    """Q4_0 block b times float32 x: d sum (code - 8) x."""
    o = b * _Q4_0_BYTES
    return f16(src, o) * _nibbles_fdot(src, o + 2, x, b * _QK, 8)


@numba.njit(inline="always", nogil=True, fastmath=_DOT_FASTMATH)
def _q4_1_block(src, b, x, xsum32):
    """Q4_1 block b times float32 x: d sum code x + m sum x."""
    o = b * _Q4_1_BYTES
    return f16(src, o) * _nibbles_fdot(src, o + 4, x, b * _QK, 0) + f16(src, o + 2) * xsum32[b]


@numba.njit(inline="always", nogil=True, fastmath=_DOT_FASTMATH)
def _q5_0_block(src, b, x, xsum32):
    """Q5_0 block b times float32 x: d sum (code - 16) x."""
    o = b * _Q5_0_BYTES
    return f16(src, o) * _codes5_fdot(src, o + 2, o + 6, x, b * _QK, 16)


@numba.njit(inline="always", nogil=True, fastmath=_DOT_FASTMATH)
def _q5_1_block(src, b, x, xsum32):
    """Q5_1 block b times float32 x: d sum code x + m sum x."""
    o = b * _Q5_1_BYTES
    return f16(src, o) * _codes5_fdot(src, o + 4, o + 8, x, b * _QK, 0) + f16(src, o + 2) * xsum32[b]


# One row of each type times float32 x, straight from the blocks (Q4_1 and Q5_1 take m sum x from xsum32)
dot_q4_0 = pairs_then_blocks(fdot_q4_0_row, _q4_0_block)
dot_q4_1 = pairs_then_blocks(fdot_q4_1_row, _q4_1_block)
dot_q5_0 = pairs_then_blocks(fdot_q5_0_row, _q5_0_block)
dot_q5_1 = pairs_then_blocks(fdot_q5_1_row, _q5_1_block)


@numba.njit(inline="always", nogil=True, fastmath=_DOT_FASTMATH)
def dot_q2_0(src, x, xsum32):
    """One Q2_0 row times float32 x, straight from the blocks: per block d * sum (code - 1) x."""
    return fdot_q2_0_row(src, x, x.shape[0] // _QK2)


# Q2_0 quantizer: ggml's own rule (d = amax, codes = round(x / d) + 1) leaves most weights at zero,
# so this one searches the scale.  Grid {-d, 0, d, 2d} is lopsided: a negative d puts the 2|d| level
# on the negative side, so both signs are tried.
_Q2_0_SCALE_STEPS = 25  # candidate |d| = amax * t, t = 1/4 + s/32: includes 1/2 and 1, the exact scales of grid data


@numba.njit(nogil=True, inline="always")
def _q2_0_codes_error(x, d, codes):
    """Nearest codes for scale d (as stored, fp16-rounded) and the squared error they leave."""
    err = 0.0
    inv = 1.0 / d if d != 0 else 0.0
    for j in range(x.shape[0]):
        q = min(2.0, max(-1.0, np.rint(x[j] * inv)))
        codes[j] = np.uint8(q + 1)
        e = np.float64(x[j]) - q * d
        err += e * e
    return err


@numba.njit(nogil=True, inline="always")
def _q2_0_lsq_scale(x, codes):
    """Least-squares scale for fixed codes: sum(x q) / sum(q^2)."""
    num = 0.0
    den = 0.0
    for j in range(x.shape[0]):
        q = np.float64(codes[j]) - 1.0
        num += x[j] * q
        den += q * q
    return num / den if den > 0 else 0.0


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _quantize_q2_0_blocks(x, scales, codes):
    for b in numba.prange(x.shape[0]):
        xb = x[b]
        amax = 0.0
        for j in range(_QK2):
            amax = max(amax, abs(np.float64(xb[j])))
        trial = np.empty(_QK2, np.uint8)
        refined = np.empty(_QK2, np.uint8)
        codes[b, :] = 1  # code 1 = value 0: the answer for an all-zero block
        best_d = 0.0
        best_err = np.inf
        if amax > 0:
            for step in range(_Q2_0_SCALE_STEPS):
                t = 0.25 + 0.75 * step / (_Q2_0_SCALE_STEPS - 1)
                for sign in (1.0, -1.0):
                    d = np.float64(round_to_half(np.float32(sign * amax * t)))
                    err = _q2_0_codes_error(xb, d, trial)
                    if err < best_err:
                        best_err, best_d = err, d
                        codes[b, :] = trial
                    # one refinement step: the least-squares scale for these codes, then its codes
                    d2 = np.float64(round_to_half(np.float32(_q2_0_lsq_scale(xb, trial))))
                    if d2 != 0:
                        err2 = _q2_0_codes_error(xb, d2, refined)
                        if err2 < best_err:
                            best_err, best_d = err2, d2
                            codes[b, :] = refined
        scales[b] = best_d


def quantize_q2_0(values: np.ndarray) -> bytes:
    """Quantize float32 [rows, k] (k a multiple of 64) to Q2_0 blocks, row-major, as bytes.

    Per block, picks the fp16 scale d (either sign) and the codes that minimize the squared error
    over the grid {-d, 0, d, 2d}; values already on such a grid come back exactly.
    """
    x = np.asarray(values)
    if x.ndim != 2 or x.shape[1] % _QK2:
        raise ValueError(f"Q2_0 quantizes a [rows, k] matrix with k a multiple of {_QK2}, got shape {x.shape}")
    x = np.ascontiguousarray(x, np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError("Q2_0 cannot hold NaN or infinite values")
    if x.size and np.abs(x).max() > 65504.0:
        raise ValueError("values above 65504 in magnitude overflow Q2_0's fp16 scale; rescale them first")
    blocks = x.reshape(-1, _QK2)
    scales = np.empty(blocks.shape[0], np.float32)  # each one an fp16 value already
    codes = np.empty((blocks.shape[0], _QK2), np.uint8)
    _quantize_q2_0_blocks(blocks, scales, codes)
    packed = codes.reshape(-1, 16, 4) << np.array([0, 2, 4, 6], np.uint8)
    qs = np.bitwise_or.reduce(packed, axis=-1)
    d = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return np.concatenate([d, qs], axis=1).tobytes()


register_type(Q4_0, "Q4_0", _QK, _Q4_0_BYTES, act_block=32)
register_type(Q4_1, "Q4_1", _QK, _Q4_1_BYTES, act_block=32)
register_type(Q5_0, "Q5_0", _QK, _Q5_0_BYTES, act_block=32)
register_type(Q5_1, "Q5_1", _QK, _Q5_1_BYTES, act_block=32)
register_type(Q2_0, "Q2_0", _QK2, _Q2_0_BYTES, act_block=32)
