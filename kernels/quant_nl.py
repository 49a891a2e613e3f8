"""ggml's 4-bit lookup-table formats: IQ4_NL, IQ4_XS and MXFP4.

Each 4-bit code indexes a 16-entry table of levels; a scale per block multiplies the level.
Layouts (ggml-common.h):
  IQ4_NL  32 weights, 18 bytes: fp16 d, qs[16]                 value = d * KVALUES_IQ4NL[code]
  IQ4_XS  256 weights, 136 bytes: fp16 d, uint16 scales_h, scales_l[4], qs[128], in 8 sub-blocks
          of 32: 6-bit scale ls = low 4 bits from scales_l (nibble ib % 2 of byte ib // 2) | 2 high
          bits from scales_h (bits 2 ib, 2 ib + 1); value = (d * (ls - 32)) * KVALUES_IQ4NL[code]
  MXFP4   32 weights, 17 bytes: e8m0 exponent e, qs[16]          value = KVALUES_FP4[code] * 2^(e - 128)
          (the e2m1 levels are stored doubled, so the scale carries the halving: ggml's
          GGML_E8M0_TO_FP32_HALF)
In every 32-weight group byte j holds weight j in its low nibble and weight j + 16 in its high one.

Activation rounding: IQ4_NL and MXFP4 dot with Q8_0 activations (32 values), IQ4_XS with Q8_K (256).
"""

import numba
import numpy as np

from .ggml_blocks import f16, u16
from .quant import register_type
from .simd import HAS_AVX512BW, IQ4_LEVELS, fdot_iq4_nl_row, fdot_iq4_xs_row

IQ4_NL, IQ4_XS, MXFP4 = 20, 23, 39

KVALUES_IQ4NL = np.array(IQ4_LEVELS, np.float32)
KVALUES_FP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)  # e2m1, doubled

_QK = 32
_QK_K = 256
_IQ4_NL_BYTES, _IQ4_XS_BYTES, _MXFP4_BYTES = 18, 136, 17


@numba.njit(nogil=True, inline="always")
def _decode_nibbles(src, o, scale, levels, dst, y):
    """32 weights from the 16 bytes at src[o:]: low nibbles -> dst[y:y+16], high -> dst[y+16:y+32]."""
    for j in range(16):
        q = src[o + j]
        dst[y + j] = scale * levels[q & 0xF]
        dst[y + j + 16] = scale * levels[q >> 4]


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_iq4_nl(src, dst):
    for b in range(dst.shape[0] // _QK):
        o = b * _IQ4_NL_BYTES
        _decode_nibbles(src, o + 2, f16(src, o), KVALUES_IQ4NL, dst, b * _QK)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_iq4_xs(src, dst):
    for b in range(dst.shape[0] // _QK_K):
        o = b * _IQ4_XS_BYTES
        d = f16(src, o)
        scales_h = np.int64(u16(src, o + 2))
        for ib in range(_QK_K // _QK):
            low = (np.int64(src[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF
            ls = low | (((scales_h >> (2 * ib)) & 3) << 4)
            dl = d * np.float32(ls - 32)
            _decode_nibbles(src, o + 8 + 16 * ib, dl, KVALUES_IQ4NL, dst, b * _QK_K + _QK * ib)


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def dot_iq4_xs(src, x, xsum32):
    """One IQ4_XS row times float32 x, straight from the blocks (simd.fdot_iq4_xs_row)."""
    return fdot_iq4_xs_row(src, x, x.shape[0] // _QK_K)


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def dot_iq4_nl(src, x, xsum32):
    """One IQ4_NL row times float32 x: pairs of blocks straight from the bytes (simd.fdot_iq4_nl_row, AVX-512BW),
    the rest block by block."""
    acc = np.float32(0.0)
    first = 0
    if HAS_AVX512BW:
        first = x.shape[0] // 64 * 2
        acc = fdot_iq4_nl_row(src, x, first // 2)
    for b in range(first, x.shape[0] // _QK):
        o, y = b * _IQ4_NL_BYTES, b * _QK
        s = np.float32(0.0)
        for j in range(16):
            q = src[o + 2 + j]
            s += KVALUES_IQ4NL[q & 0xF] * x[y + j] + KVALUES_IQ4NL[q >> 4] * x[y + j + 16]
        acc += f16(src, o) * s
    return acc


@numba.njit(nogil=True, inline="always")
def _e8m0_half(e):
    """2^(e - 128) as float32, exactly (e = 0 and 1 give float32 subnormals)."""
    bits = np.uint32(0x00200000) << np.uint32(e) if e < 2 else np.uint32(e - 1) << np.uint32(23)
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_mxfp4(src, dst):
    for b in range(dst.shape[0] // _QK):
        o = b * _MXFP4_BYTES
        _decode_nibbles(src, o + 1, _e8m0_half(np.int64(src[o])), KVALUES_FP4, dst, b * _QK)


register_type(IQ4_NL, "IQ4_NL", _QK, _IQ4_NL_BYTES, act_block=32)
register_type(IQ4_XS, "IQ4_XS", _QK_K, _IQ4_XS_BYTES, act_block=256)
register_type(MXFP4, "MXFP4", _QK, _MXFP4_BYTES, act_block=32)
