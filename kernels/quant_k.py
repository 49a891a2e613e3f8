"""The k-quants Q2_K ... Q6_K: super-blocks of 256 weights split into sub-blocks of 16 or 32.

Each super-block holds fp16 super-scales and small integer sub-block scales (and, for Q2_K, Q4_K and
Q5_K, sub-block minimums).  Decoding follows ggml's float32 operation order exactly
(``(d * sc) * q - (dmin * m)``, ``(d * sc) * q``) so results are bit-identical to ggml's.
All arithmetic stays in float32, as in ggml.
"""

import numba
import numpy as np

from .ggml_blocks import f16, q3_scale, scale_min_k4
from .quant import register_type
from .simd import dequant_nibbles_32, dequant_q2_32, dequant_q6_half, fdot_q2_k_row, fdot_q3_k_row

Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
_QK_K = 256  # weights per super-block
# ggml's k-quant dot products quantize activations to Q8_K: 256 values per block.
_ACT_BLOCK = 256

# Block byte layouts (ggml-common.h), offsets within one super-block.
# Q2_K: scales[16] (low nibble: scale, high nibble: min), qs[64] (2-bit), d, dmin
_Q2_BYTES = 84
# Q3_K: hmask[32] (high bit), qs[64] (low 2 bits), scales[12] (16 packed 6-bit), d
_Q3_BYTES = 110
# Q4_K: d, dmin, scales[12] (8 scales + 8 mins, packed 6-bit), qs[128] (4-bit)
_Q4_BYTES = 144
# Q5_K: d, dmin, scales[12] (as Q4_K), qh[32] (fifth bit), qs[128] (low 4 bits)
_Q5_BYTES = 176
# Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d
_Q6_BYTES = 210


@numba.njit(inline="always", nogil=True)
def _q2_scale_min(src, i, d, dmin):
    """Q2_K sub-block (scale, min) from byte i: low nibble times d, high nibble times dmin."""
    return d * np.float32(src[i] & 0xF), dmin * np.float32(src[i] >> 4)


# The decoders read each packed byte once and write every weight it holds: a separate pass over the
# bytes per bit field measured 2-3x slower.


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q2_k(src, dst):
    for b in range(dst.shape[0] // _QK_K):
        o = b * _Q2_BYTES
        d = f16(src, o + 80)
        dmin = f16(src, o + 82)
        # Two halves of 128 weights, each from 32 qs bytes: bits 2j..2j+1 of byte l give weight
        # 32 * j + l; each run of 16 weights has its own (scale, min) byte, number 8 * half + 2 * j + l // 16.
        for half in range(2):
            for j in range(4):
                dl0, ml0 = _q2_scale_min(src, o + 8 * half + 2 * j, d, dmin)
                dl1, ml1 = _q2_scale_min(src, o + 8 * half + 2 * j + 1, d, dmin)
                dequant_q2_32(src, o + 16 + 32 * half, 2 * j, dl0, ml0, dl1, ml1, dst, b * _QK_K + 128 * half + 32 * j)


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def dot_q2_k(src, x, xsum32):
    """One Q2_K row times float32 x, straight from the blocks (simd.fdot_q2_k_row)."""
    return fdot_q2_k_row(src, x, x.shape[0] // _QK_K)


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def dot_q3_k(src, x, xsum32):
    """One Q3_K row times float32 x, straight from the blocks (simd.fdot_q3_k_row)."""
    return fdot_q3_k_row(src, x, x.shape[0] // _QK_K)


@numba.njit(inline="always", nogil=True)
def _q3_value(v, shift, h, hbit):
    """3-bit Q3_K value: 2 bits of v at `shift`, minus 4 unless bit `hbit` of the hmask byte h is set."""
    return np.float32(np.int32((v >> shift) & 3) - (0 if (h >> hbit) & 1 else 4))


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q3_k(src, dst):
    for b in range(dst.shape[0] // _QK_K):
        o = b * _Q3_BYTES
        d = f16(src, o + 108)
        # As Q2_K (without mins), plus a high bit per weight: bit 4 * half + j of hmask byte
        # 16 * part + l; a clear bit offsets the value by -4.
        for half in range(2):
            for part in range(2):
                s = 8 * half + part
                dl0 = d * np.float32(q3_scale(src, o + 96, s))
                dl1 = d * np.float32(q3_scale(src, o + 96, s + 2))
                dl2 = d * np.float32(q3_scale(src, o + 96, s + 4))
                dl3 = d * np.float32(q3_scale(src, o + 96, s + 6))
                hm = o + 16 * part
                qs = o + 32 + 32 * half + 16 * part
                y = b * _QK_K + 128 * half + 16 * part
                hb = 4 * half
                for l in range(16):
                    v = src[qs + l]
                    h = src[hm + l]
                    dst[y + l] = dl0 * _q3_value(v, 0, h, hb)
                    dst[y + 32 + l] = dl1 * _q3_value(v, 2, h, hb + 1)
                    dst[y + 64 + l] = dl2 * _q3_value(v, 4, h, hb + 2)
                    dst[y + 96 + l] = dl3 * _q3_value(v, 6, h, hb + 3)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q4_k(src, dst):
    for b in range(dst.shape[0] // _QK_K):
        o = b * _Q4_BYTES
        d = f16(src, o)
        dmin = f16(src, o + 2)
        # Four groups of 64 weights from 32 bytes: low nibbles are sub-block 2g, high nibbles 2g + 1.
        for g in range(4):
            sc, m = scale_min_k4(src, o + 4, 2 * g)
            d1 = d * np.float32(sc)
            m1 = dmin * np.float32(m)
            sc, m = scale_min_k4(src, o + 4, 2 * g + 1)
            d2 = d * np.float32(sc)
            m2 = dmin * np.float32(m)
            dequant_nibbles_32(src, o + 16 + 32 * g, d1, m1, d2, m2, dst, b * _QK_K + 64 * g)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q5_k(src, dst):
    for b in range(dst.shape[0] // _QK_K):
        o = b * _Q5_BYTES
        d = f16(src, o)
        dmin = f16(src, o + 2)
        # As Q4_K, plus a fifth bit (worth 16): bit s of qh byte l for sub-block s.
        for g in range(4):
            sc, m = scale_min_k4(src, o + 4, 2 * g)
            d1 = d * np.float32(sc)
            m1 = dmin * np.float32(m)
            sc, m = scale_min_k4(src, o + 4, 2 * g + 1)
            d2 = d * np.float32(sc)
            m2 = dmin * np.float32(m)
            qh = o + 16
            qs = o + 48 + 32 * g
            y = b * _QK_K + 64 * g
            for l in range(32):
                v = src[qs + l]
                h = src[qh + l] >> (2 * g)
                dst[y + l] = d1 * np.float32((v & 0xF) | ((h & 1) << 4)) - m1
                dst[y + 32 + l] = d2 * np.float32((v >> 4) | ((h & 2) << 3)) - m2


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q6_k(src, dst):
    for b in range(dst.shape[0] // _QK_K):
        o = b * _Q6_BYTES
        d = f16(src, o + 208)
        # Two halves of 128 weights from 64 ql + 32 qh bytes.  For l < 32, weights l, l + 32, l + 64,
        # l + 96 take the low nibble of ql byte l, of ql byte l + 32, the high nibble of byte l, of
        # byte l + 32, and bit pairs 0, 1, 2, 3 of qh byte l; values are offset by -32.  Each run
        # of 16 weights has its own int8 scale, number 8 * half + 2 * (l // 32) + l % 32 // 16.
        for half in range(2):
            dequant_q6_half(src, o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half, d, dst,
                            b * _QK_K + 128 * half)


register_type(Q2_K, "Q2_K", _QK_K, _Q2_BYTES, act_block=_ACT_BLOCK)
register_type(Q3_K, "Q3_K", _QK_K, _Q3_BYTES, act_block=_ACT_BLOCK)
register_type(Q4_K, "Q4_K", _QK_K, _Q4_BYTES, act_block=_ACT_BLOCK)
register_type(Q5_K, "Q5_K", _QK_K, _Q5_BYTES, act_block=_ACT_BLOCK)
register_type(Q6_K, "Q6_K", _QK_K, _Q6_BYTES, act_block=_ACT_BLOCK)
