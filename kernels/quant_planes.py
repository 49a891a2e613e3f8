"""IQ2_XS_PLANES: IQ2_XS weights repacked at load into level planes and sign bits, for the CPU's dots.

An IQ2_XS group of 8 values is a 9-bit index into a 512-point grid of byte magnitudes (8, 25 or 43) and a 7-bit
sign index whose eighth sign is the parity of the seven. Its integer dot spends most of its instructions putting
those back together (the grid look-up, the signs, the per-step bit spreading), not multiplying: 0.050 ns a weight
from the cache on a Zen 4 core, where Q4_K's dot takes 0.035. The planes hold the same values ready for the vector
unit: each value's magnitude level as 2 bits (four steps of 64 values in one 64-byte vector), its sign as a bit
(a step's 64 signs are one mask register), the fp16 d and the 4-bit run scales as IQ2_XS has them
(simd.PLANES_*). 106 bytes per 256 values where IQ2_XS takes 74: 1.43x the memory, never twice, for a dot 1.5-1.75x
as fast (bench/README.md). Nothing is lost or rounded: the values, scales and each run's integer sum are IQ2_XS's.

The values lie in a run-per-lane order (simd.PLANES_ORDER: each 4-byte lane of a 64-value step holds four values
of one run of 16), so the integer dot sums a block's four steps into one vector and multiplies by the run scales
once. The activations go into that order once per input (planes_order_i8 / planes_order_f32, called by
quant_dispatch.int_ready / float_ready), and a row's float sum groups the products by run: a row agrees with
IQ2_XS's own dot to float rounding, not to the bit.

The engine repacks IQ2_XS tensors at load (runtime/weights.py) where the CPU has AVX-512 VBMI and the result fits
in RAM; the type never appears in a file.
"""

import numba
import numpy as np

from .ggml_blocks import f16
from .quant import register_type
from .quant_iq import _IQ2XS_WORDS, _KSIGNS
from .simd import (HAS_F16C, HAS_VBMI_BITALG, IQ2_XS_MAGNITUDES, PLANES_BYTES, PLANES_LEVELS, PLANES_POSITION,
                   PLANES_SCALES, PLANES_SIGNS, dequant_planes_block, fdot_planes_blocks, fdot_planes_row,
                   order_planes_f32, order_planes_i8)

IQ2_XS_PLANES = 1017  # an in-memory type: ggml's numbering stops far below
_IQ2_XS_BYTES = 74
_QK = 256
# The planes' vector dots need vpermb (AVX-512 VBMI; AVX-512BW for the rest) and vcvtph2ps.
AVAILABLE = HAS_VBMI_BITALG and HAS_F16C

register_type(IQ2_XS_PLANES, "IQ2_XS_PLANES", _QK, PLANES_BYTES, act_block=_QK, in_files=False)

_MAGNITUDES = np.array(IQ2_XS_MAGNITUDES + (0,), np.float32)
_POSITION = np.array(PLANES_POSITION, np.int32)  # value v's position u in a block (simd.PLANES_ORDER[u] == v)


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=False)
def repack_iq2_xs(src, dst):
    """IQ2_XS rows src [rows, row bytes] -> IQ2_XS_PLANES rows dst [rows, blocks * 106]: per group of 8 values its
    grid point's levels (_IQ2XS_WORDS: value j's at bits 2 j) and its eight sign bits (ggml's ksigns of the 7
    stored) to their values' positions (simd.PLANES_ORDER) in the level planes and sign bytes; d and the scale
    bytes copied."""
    blocks = src.shape[1] // _IQ2_XS_BYTES
    for r in numba.prange(src.shape[0]):
        for b in range(blocks):
            i, o = _IQ2_XS_BYTES * b, PLANES_BYTES * b
            dst[r, o] = src[r, i]
            dst[r, o + 1] = src[r, i + 1]
            for k in range(8):
                dst[r, o + PLANES_SCALES + k] = src[r, i + 66 + k]
            for k in range(PLANES_SCALES + 8, PLANES_BYTES):
                dst[r, o + k] = 0
            for g in range(32):
                code = np.uint16(src[r, i + 2 + 2 * g]) | np.uint16(src[r, i + 3 + 2 * g]) << np.uint16(8)
                signs = _KSIGNS[code >> 9]
                levels = _IQ2XS_WORDS[code & 511]
                for j in range(8):
                    u = _POSITION[8 * g + j]
                    level = np.uint8(levels >> (2 * j) & 3)
                    dst[r, o + PLANES_LEVELS + u % 64] |= level << np.uint8(2 * (u // 64))
                    dst[r, o + PLANES_SIGNS + u // 8] |= np.uint8(signs >> j & 1) << np.uint8(u % 8)


def repack(data: np.ndarray) -> np.ndarray:
    """IQ2_XS blocks [..., row bytes] (any leading shape: a matrix, or experts x rows) as a new IQ2_XS_PLANES
    array [..., blocks * 106]."""
    rows = data.reshape(-1, data.shape[-1])
    if rows.shape[-1] % _IQ2_XS_BYTES:
        raise ValueError(f"IQ2_XS rows of {rows.shape[-1]} bytes are not whole 74-byte blocks")
    out = np.empty((rows.shape[0], rows.shape[1] // _IQ2_XS_BYTES * PLANES_BYTES), np.uint8)
    repack_iq2_xs(rows, out)
    return out.reshape(*data.shape[:-1], out.shape[-1])


@numba.njit(inline="always", nogil=True)
def _value(src, o, v):
    """Value v's magnitude (float32) and sign bit of the block at src[o] (at its position u)."""
    u = _POSITION[v]
    level = src[o + PLANES_LEVELS + u % 64] >> (2 * (u // 64)) & 3
    return _MAGNITUDES[level], src[o + PLANES_SIGNS + u // 8] >> (u % 8) & 1


@numba.njit(nogil=True, fastmath=False)
def dequant_planes(src, dst):
    """One row of IQ2_XS_PLANES blocks to float32, in ggml's dequantize_row_iq2_xs order: per 16 values db = d *
    (0.5 + s) * 0.25, then db * magnitude, negated where the sign bit is set (simd.dequant_planes_block, 64 values
    a step)."""
    for b in range(dst.shape[0] // _QK):
        o = PLANES_BYTES * b
        dequant_planes_block(src, o, f16(src, o), dst, _QK * b)


@numba.njit(nogil=True, fastmath=False)
def dequant_planes_loop(src, dst):
    """dequant_planes value by value (the tests' second reading of the layout)."""
    for b in range(dst.shape[0] // _QK):
        o = PLANES_BYTES * b
        d = f16(src, o)
        for run in range(16):
            s = src[o + PLANES_SCALES + run // 2] >> (4 * (run % 2)) & 15
            db = d * (np.float32(0.5) + np.float32(s)) * np.float32(0.25)
            for k in range(16):
                v = 16 * run + k
                magnitude, neg = _value(src, o, v)
                y = db * magnitude
                dst[_QK * b + v] = -y if neg else y


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def _planes_loop(src, x, xd):
    """sum over blocks b of d_b xd[b] / 8 times sum over runs (2 s + 1) sum magnitude * sign * x, x int8 codes or
    float32 values (xd ones): the portable dot, for CPUs without the vector one (and the tests)."""
    acc = np.float32(0.0)
    for b in range(x.shape[0] // _QK):
        o = PLANES_BYTES * b
        block = 0.0  # float64: the integer sums stay exact past float32's 2^24
        for run in range(16):
            s = np.int32(src[o + PLANES_SCALES + run // 2] >> (4 * (run % 2)) & 15)
            part = np.float32(0.0)
            for k in range(16):
                v = 16 * run + k
                magnitude, neg = _value(src, o, v)
                xv = np.float32(x[_QK * b + v])
                part += -magnitude * xv if neg else magnitude * xv
            block += (2 * s + 1) * np.float64(part)
        acc += f16(src, o) * xd[b] * np.float32(block)
    return acc * np.float32(0.125)


@numba.njit(nogil=True, cache=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def planes_loop(src, x, xd):
    """_planes_loop as a kernel of its own (tests)."""
    return _planes_loop(src, x, xd)


@numba.njit(inline="always", nogil=True)
def planes_order_f32(x):
    """Float32 activations in the planes' value order (simd.PLANES_ORDER), as dot_planes takes them: a new array
    where the vector dot runs, x itself for the portable one (once per input: quant_dispatch.float_ready)."""
    if AVAILABLE:
        xo = np.empty(x.shape[0], np.float32)
        order_planes_f32(x, xo, x.shape[0] // _QK)
        return xo
    return x


@numba.njit(inline="always", nogil=True)
def planes_order_i8(xq):
    """planes_order_f32 for int8 activation codes (idot_planes)."""
    if AVAILABLE:
        xo = np.empty(xq.shape[0], np.int8)
        order_planes_i8(xq, xo, xq.shape[0] // _QK)
        return xo
    return xq


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def dot_planes(src, xo):
    """One IQ2_XS_PLANES row times float32 activations xo from planes_order_f32."""
    if AVAILABLE:
        return fdot_planes_row(src, xo, xo.shape[0] // _QK)
    return _planes_loop(src, xo, np.ones(xo.shape[0] // _QK, np.float32))


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def idot_planes(src, xo, xd):
    """One IQ2_XS_PLANES row times Q8_K activations (codes xo from planes_order_i8, block scales xd): IQ2_XS's
    integer dot (ggml's vec_dot_iq2_xs_q8_K)."""
    if AVAILABLE:
        return fdot_planes_blocks(src, xo, xd, xo.shape[0] // _QK)
    return _planes_loop(src, xo, xd)
