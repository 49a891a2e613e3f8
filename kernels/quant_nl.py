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

from .ggml_blocks import e8m0_half, f16, u16
from .quant import register_type
from .quant_legacy import pairs_then_blocks
from .simd import FP4_LEVELS, IQ4_LEVELS, fdot_iq4_nl_row, fdot_iq4_xs_row, fdot_mxfp4_row

IQ4_NL, IQ4_XS, MXFP4 = 20, 23, 39

KVALUES_IQ4NL = np.array(IQ4_LEVELS, np.float32)
KVALUES_FP4 = np.array(FP4_LEVELS, np.float32)  # e2m1, doubled

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
def _levels_fdot(levels, src, q0, x, y):
    """The 16 code bytes at src[q0] (byte j's low nibble value j, its high nibble value j + 16) through levels,
    times float32 x[y:y + 32]."""
    s = np.float32(0.0)
    for j in range(16):
        q = src[q0 + j]
        s += levels[q & 0xF] * x[y + j] + levels[q >> 4] * x[y + j + 16]
    return s


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def _iq4_nl_block(src, b, x, xsum32):
    """IQ4_NL block b times float32 x: d sum level x."""
    o = b * _IQ4_NL_BYTES
    return f16(src, o) * _levels_fdot(KVALUES_IQ4NL, src, o + 2, x, b * _QK)


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def _mxfp4_block(src, b, x, xsum32):
    """MXFP4 block b times float32 x: the halved power-of-two scale times the doubled e2m1 values times x."""
    o = b * _MXFP4_BYTES
    return e8m0_half(np.int64(src[o])) * _levels_fdot(KVALUES_FP4, src, o + 1, x, b * _QK)


# One row times float32 x: pairs of blocks straight from the bytes (simd.fdot_*_row), then block by block
dot_iq4_nl = pairs_then_blocks(fdot_iq4_nl_row, _iq4_nl_block)
dot_mxfp4 = pairs_then_blocks(fdot_mxfp4_row, _mxfp4_block)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_mxfp4(src, dst):
    for b in range(dst.shape[0] // _QK):
        o = b * _MXFP4_BYTES
        _decode_nibbles(src, o + 1, e8m0_half(np.int64(src[o])), KVALUES_FP4, dst, b * _QK)


register_type(IQ4_NL, "IQ4_NL", _QK, _IQ4_NL_BYTES, act_block=32)
register_type(IQ4_XS, "IQ4_XS", _QK_K, _IQ4_XS_BYTES, act_block=256)
register_type(MXFP4, "MXFP4", _QK, _MXFP4_BYTES, act_block=32)
