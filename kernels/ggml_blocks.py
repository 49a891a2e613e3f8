"""Scalar readers shared by the ggml block decoders (Numba, inlined).

Numba has no float16 type, so half floats are decoded from their bits here, once, for every format.
"""

import numba
import numpy as np

from .simd import HAS_F16C, f32_bits, f32_from_bits, load_f16


@numba.njit(inline="always", nogil=True)
def u16(src, off):
    """Little-endian uint16 at byte offset `off`."""
    return np.uint32(src[off]) | (np.uint32(src[off + 1]) << 8)


@numba.njit(inline="always", nogil=True)
def u32(src, off):
    """Little-endian uint32 at byte offset `off`."""
    return (np.uint32(src[off]) | (np.uint32(src[off + 1]) << 8)
            | (np.uint32(src[off + 2]) << 16) | (np.uint32(src[off + 3]) << 24))


@numba.njit(inline="always", nogil=True)
def scale_min_k4(src, off, j):
    """Sub-block j's 6-bit (scale, min) from the 12 packed bytes at `off` (Q4_K, Q5_K).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales/mins 4-7 take their low
    nibble from bytes 8-11 and their top 2 bits from the spare high bits of bytes 0-3 / 4-7.
    """
    if j < 4:
        return np.int32(src[off + j] & 63), np.int32(src[off + j + 4] & 63)
    sc = (src[off + j + 4] & 0xF) | ((src[off + j - 4] >> 6) << 4)
    m = (src[off + j + 4] >> 4) | ((src[off + j] >> 6) << 4)
    return np.int32(sc), np.int32(m)


@numba.njit(inline="always", nogil=True)
def q3_scale(src, off, s):
    """Sub-block s's signed 6-bit scale (-32..31) from the 12 packed bytes at `off` (Q3_K).

    Low nibbles: bytes 0-7 (low nibble for scales 0-7, high nibble for 8-15); top 2 bits: byte
    8 + s % 4, bit pair s // 4.
    """
    lo = np.int32(src[off + s] & 0xF) if s < 8 else np.int32(src[off + s - 8] >> 4)
    hi = (np.int32(src[off + 8 + (s & 3)]) >> (2 * (s >> 2))) & 3
    return (lo | (hi << 4)) - 32


@numba.njit(inline="always", nogil=True)
def half_to_float(h):
    """IEEE half (given as its 16 bits) to float32, exactly: (1024 + mantissa) * 2^(exp - 25), each
    factor and product exact in float32, and no temporary array (this runs once per block)."""
    exp = np.int32((h >> 10) & 0x1F)
    mant = np.int32(h & 0x3FF)
    sign = np.float32(-1.0) if h & 0x8000 else np.float32(1.0)
    if exp == 0:  # zero or subnormal: mant * 2^-24
        return sign * np.float32(mant) * np.float32(5.960464477539063e-08)
    if exp == 31:
        return sign * np.float32(np.inf) if mant == 0 else np.float32(np.nan)
    return sign * np.float32(mant + 1024) * np.float32(np.int64(1) << exp) * np.float32(2.9802322387695312e-08)


@numba.njit(inline="always", nogil=True)
def _f16_bits(src, off):
    return half_to_float(u16(src, off))


# fp16 value stored little-endian at byte offset `off` of a uint8 array: one instruction where the CPU
# converts halves (the bit decode above cost as much as a Q8_0 block's whole dot product), else the decode.
f16 = load_f16 if HAS_F16C else _f16_bits


@numba.njit(inline="always", nogil=True)
def e8m0_half(e):
    """2^(e - 128) as float32 for an e8m0 exponent byte e, exactly (e = 0 and 1 give float32 subnormals): MXFP4's
    block scale, halved because its e2m1 values are held doubled, as integers."""
    return f32_from_bits(np.uint32(0x00200000) << np.uint32(e) if e < 2 else np.uint32(e - 1) << np.uint32(23))


@numba.njit(inline="always", nogil=True)
def round_to_half(x):
    """float32 -> nearest fp16 value (ties to even), returned as float32: ggml's FP32_TO_FP16."""
    ax = abs(x)
    if ax < np.float32(6.103515625e-05):  # fp16 subnormal range: a multiple of 2^-24
        return np.float32(np.rint(x * np.float32(16777216.0)) * np.float32(5.960464477539063e-08))
    if ax >= np.float32(65520.0):
        return np.float32(np.inf) if x > 0 else np.float32(-np.inf)
    b = f32_bits(np.float32(x))
    b = (b + np.uint32(0xFFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return f32_from_bits(b)
