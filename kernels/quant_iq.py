"""i-quants: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S.

Blocks of 256 weights whose groups of 8 (or 4) values are indices into fixed lattice grids,
with separate sign bits and small per-32 (or per-16) scales.  The grids and the sign table are
taken from the gguf package at import (the same tables ggml compiles in), so no table is
copied here.  Each decoder follows ggml's dequantize_row_iq* operation order in float32, so
results are bit-exact with ggml and gguf.quants.dequantize.  ggml multiplies all of them with
Q8_K activations (per 256 values).
"""

import numba
import numpy as np
from gguf import quants as gguf_quants

from .ggml_blocks import f16, half_to_float, u16, u32
from .quant import register_type
from .simd import (HAS_AVX512BW, HAS_F16C, IQ2_XS_MAGNITUDES, IQ2_XS_POINTS, dequant_iq2_xs_block,
                   fdot_iq2_xs_blocks, fdot_iq2_xs_row, fdot_iq2_xxs_blocks, fdot_iq2_xxs_row, fdot_iq3_xxs_blocks,
                   fdot_iq3_xxs_row, fdot_iq2_s_blocks, fdot_iq2_s_row, fdot_iq3_s_blocks, fdot_iq3_s_row,
                   fdot_iq1_s_blocks, fdot_iq1_s_row, fdot_iq1_m_blocks, fdot_iq1_m_row, idot_iq2_xs_block)

IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ1_M = 16, 17, 18, 19, 21, 22, 29
_QK = 256
_Q8_K = 256  # activation block: ggml's vec_dot_type for every i-quant is Q8_K


def _grid(quant_cls) -> np.ndarray:
    """A gguf quant class's lattice grid as a [points, values] float32 array (exact small integers)."""
    quant_cls.init_grid()
    grid = quant_cls.grid
    return np.ascontiguousarray(grid.reshape(grid.shape[-2], grid.shape[-1]), np.float32)


# ggml's iq2xxs_grid / iq2xs_grid / iq2s_grid (8 values per point), iq3xxs_grid / iq3s_grid (4 values),
# iq1s_grid (8 values in {-1, 0, 1}, shared by IQ1_S and IQ1_M).
_IQ2XXS_GRID = _grid(gguf_quants.IQ2_XXS)
_IQ2XS_GRID = _grid(gguf_quants.IQ2_XS)
_IQ2S_GRID = _grid(gguf_quants.IQ2_S)
_IQ3XXS_GRID = _grid(gguf_quants.IQ3_XXS)
_IQ3S_GRID = _grid(gguf_quants.IQ3_S)
_IQ1S_GRID = _grid(gguf_quants.IQ1_S)
# ksigns_iq2xs: 7 stored sign bits -> 8 sign bits (the 8th keeps the count of minus signs even).
_KSIGNS = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()
_IQ1_DELTA = np.float32(0.125)  # IQ1S_DELTA / IQ1M_DELTA: shift of the ternary grid values

assert _IQ2XXS_GRID.shape == (256, 8) and _IQ2XS_GRID.shape == (512, 8) and _IQ2S_GRID.shape == (1024, 8)
assert _IQ3XXS_GRID.shape == (256, 4) and _IQ3S_GRID.shape == (512, 4) and _IQ1S_GRID.shape == (2048, 8)
assert _KSIGNS.shape == (128,)
# +1 / -1 for bit j of a sign byte: applying signs by multiplication keeps the 8-value loops branch-free
# (vectorizable) instead of a select per value.
_SIGN8 = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, -1.0, 1.0).astype(np.float32)
# The IQ2_XS grid as the vector code takes it (simd.IQ2_XS_POINTS): the points as 8 byte magnitudes in a uint64,
# then as 2-bit level codes, value j's at bits 2 j of a uint16, stored as two byte planes (low bytes, then high
# bytes; the signs are computed from the code bits).
_IQ2XS_LEVELS = np.searchsorted(np.array(IQ2_XS_MAGNITUDES, np.float32), _IQ2XS_GRID).astype(np.uint16)
assert np.array_equal(np.array(IQ2_XS_MAGNITUDES, np.float32)[_IQ2XS_LEVELS], _IQ2XS_GRID)
_IQ2XS_WORDS = (_IQ2XS_LEVELS << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
_IQ2XS_TABLES = np.concatenate([
    np.ascontiguousarray(_IQ2XS_GRID.astype(np.uint8)).view(np.uint64).reshape(-1),
    np.concatenate([_IQ2XS_WORDS & 0xFF, _IQ2XS_WORDS >> 8]).astype(np.uint8).view(np.uint64)])
assert _IQ2XS_TABLES.shape == (IQ2_XS_POINTS + 128,)
# The IQ2_XXS grid as simd._iq2_xxs_blocks takes it: each point's 8 byte magnitudes (8, 25 or 43) in a uint64.
_IQ2XXS_POINTS = np.ascontiguousarray(_IQ2XXS_GRID.astype(np.uint8)).view(np.uint64).reshape(-1)
# IQ3_XXS's: each point's 4 byte magnitudes (4 to 62) in a uint32.
_IQ3XXS_POINTS = np.ascontiguousarray(_IQ3XXS_GRID.astype(np.uint8)).view(np.uint32).reshape(-1)
_IQ2XXS_INT_GRID, _IQ3XXS_INT_GRID = _IQ2XXS_GRID.astype(np.int32), _IQ3XXS_GRID.astype(np.int32)
# IQ2_S's and IQ3_S's, the same way (a uint64 of 8 magnitudes, a uint32 of 4)
_IQ2S_POINTS = np.ascontiguousarray(_IQ2S_GRID.astype(np.uint8)).view(np.uint64).reshape(-1)
_IQ3S_POINTS = np.ascontiguousarray(_IQ3S_GRID.astype(np.uint8)).view(np.uint32).reshape(-1)
_IQ2S_INT_GRID, _IQ3S_INT_GRID = _IQ2S_GRID.astype(np.int32), _IQ3S_GRID.astype(np.int32)
# IQ1_S's and IQ1_M's: each point's 8 values (-1, 0, 1) as int8 bytes of a uint64
_IQ1S_POINTS = np.ascontiguousarray(_IQ1S_GRID.astype(np.int8)).view(np.uint64).reshape(-1)
_IQ1S_INT_GRID = _IQ1S_GRID.astype(np.int32)
_SIGN8_INT = _SIGN8.astype(np.int32)


@numba.njit(inline="always", nogil=True)
def _put8(dst, y, scale, grid, point, signs):
    """dst[y:y+8] = scale * grid[point] with the value negated where bit j of `signs` is set."""
    for j in range(8):
        dst[y + j] = scale * grid[point, j] * _SIGN8[signs, j]


@numba.njit(inline="always", nogil=True)
def _put4(dst, y, scale, grid, point, signs, first_bit):
    """dst[y:y+4] = scale * grid[point], signed by bits first_bit..first_bit+3 of `signs`."""
    for j in range(4):
        v = scale * grid[point, j]
        dst[y + j] = -v if (signs >> (first_bit + j)) & 1 else v


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_iq2_xxs(src, dst):
    # block: d fp16 | 8 x (4 grid-index bytes, u32 = 4 x 7 sign bits + 4-bit scale)   (66 bytes)
    for b in range(dst.shape[0] // _QK):
        o = b * 66
        d = f16(src, o)
        for ib in range(8):
            q = o + 2 + 8 * ib
            aux = u32(src, q + 4)
            db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)
            for l in range(4):
                signs = _KSIGNS[(aux >> (7 * l)) & 127]
                _put8(dst, b * _QK + 32 * ib + 8 * l, db, _IQ2XXS_GRID, src[q + l], signs)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_iq2_xs(src, dst):
    # block: d fp16 | 32 x u16 (9-bit grid index, 7 sign bits) | 8 scale bytes (two 4-bit scales)   (74 bytes)
    for b in range(dst.shape[0] // _QK):
        o = b * 74
        dequant_iq2_xs_block(_IQ2XS_TABLES, src, o, f16(src, o), dst, b * _QK)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_iq2_s(src, dst):
    # block: d fp16 | 32 grid-index low bytes | 32 sign bytes | 8 qh (4 x 2 high index bits) | 8 scales  (82 bytes)
    for b in range(dst.shape[0] // _QK):
        o = b * 82
        d = f16(src, o)
        for ib in range(8):
            sc = src[o + 74 + ib]
            db0 = d * (np.float32(0.5) + np.float32(sc & 0xF)) * np.float32(0.25)
            db1 = d * (np.float32(0.5) + np.float32(sc >> 4)) * np.float32(0.25)
            qh = np.int32(src[o + 66 + ib])
            for l in range(4):
                point = np.int32(src[o + 2 + 4 * ib + l]) | ((qh << (8 - 2 * l)) & 0x300)
                _put8(dst, b * _QK + 32 * ib + 8 * l, db0 if l < 2 else db1,
                      _IQ2S_GRID, point, src[o + 34 + 4 * ib + l])


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_iq3_xxs(src, dst):
    # block: d fp16 | 64 grid-index bytes (4 values each) | 8 x u32 (4 x 7 sign bits + 4-bit scale)   (98 bytes)
    for b in range(dst.shape[0] // _QK):
        o = b * 98
        d = f16(src, o)
        for ib in range(8):
            aux = u32(src, o + 66 + 4 * ib)
            db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.5)
            q = o + 2 + 8 * ib
            for l in range(4):
                signs = _KSIGNS[(aux >> (7 * l)) & 127]
                y = b * _QK + 32 * ib + 8 * l
                _put4(dst, y, db, _IQ3XXS_GRID, src[q + 2 * l], signs, 0)
                _put4(dst, y + 4, db, _IQ3XXS_GRID, src[q + 2 * l + 1], signs, 4)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_iq3_s(src, dst):
    # block: d fp16 | 64 grid-index low bytes | 8 qh (high index bits) | 32 sign bytes | 4 scales  (110 bytes)
    for b in range(dst.shape[0] // _QK):
        o = b * 110
        d = f16(src, o)
        for ib in range(8):
            sc = (np.int32(src[o + 106 + ib // 2]) >> (4 * (ib % 2))) & 0xF
            db = d * np.float32(1 + 2 * sc)
            qh = np.int32(src[o + 66 + ib])
            q = o + 2 + 8 * ib
            for l in range(4):
                signs = src[o + 74 + 4 * ib + l]
                point1 = np.int32(src[q + 2 * l]) | ((qh << (8 - 2 * l)) & 256)
                point2 = np.int32(src[q + 2 * l + 1]) | ((qh << (7 - 2 * l)) & 256)
                y = b * _QK + 32 * ib + 8 * l
                _put4(dst, y, db, _IQ3S_GRID, point1, signs, 0)
                _put4(dst, y + 4, db, _IQ3S_GRID, point2, signs, 4)


@numba.njit(inline="always", nogil=True)
def _put_iq1(dst, y, scale, point, delta):
    """dst[y:y+8] = scale * (iq1s_grid[point] + delta)."""
    for j in range(8):
        dst[y + j] = scale * (_IQ1S_GRID[point, j] + delta)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_iq1_s(src, dst):
    # block: d fp16 | 32 grid-index low bytes | 8 x u16 (4 x 3 high index bits, 3-bit scale, delta sign)  (50 bytes)
    for b in range(dst.shape[0] // _QK):
        o = b * 50
        d = f16(src, o)
        for ib in range(8):
            qh = np.int32(u16(src, o + 34 + 2 * ib))
            dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
            delta = -_IQ1_DELTA if qh & 0x8000 else _IQ1_DELTA
            for l in range(4):
                point = np.int32(src[o + 2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)
                _put_iq1(dst, b * _QK + 32 * ib + 8 * l, dl, point, delta)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_iq1_m(src, dst):
    # block: 32 grid-index low bytes | 16 qh (per 8 values: 3 high index bits + delta sign)
    #        | 4 x u16 scales (four 3-bit scales each; their top nibbles together are the fp16 d)  (56 bytes)
    for b in range(dst.shape[0] // _QK):
        o = b * 56
        s0 = np.int32(u16(src, o + 48))
        s1 = np.int32(u16(src, o + 50))
        s2 = np.int32(u16(src, o + 52))
        s3 = np.int32(u16(src, o + 54))
        d = half_to_float((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000))
        for ib in range(8):
            sc = np.int32(u16(src, o + 48 + 2 * (ib // 2)))
            shift = 6 * (ib % 2)
            dl1 = d * np.float32(2 * ((sc >> shift) & 7) + 1)
            dl2 = d * np.float32(2 * ((sc >> (shift + 3)) & 7) + 1)
            y = b * _QK + 32 * ib
            for half in range(2):  # two groups of 8 values per qh byte
                qh = np.int32(src[o + 32 + 2 * ib + half])
                dl = dl1 if half == 0 else dl2
                q = o + 4 * ib + 2 * half
                point_lo = np.int32(src[q]) | ((qh << 8) & 0x700)
                point_hi = np.int32(src[q + 1]) | ((qh << 4) & 0x700)
                delta_lo = -_IQ1_DELTA if qh & 0x08 else _IQ1_DELTA
                delta_hi = -_IQ1_DELTA if qh & 0x80 else _IQ1_DELTA
                _put_iq1(dst, y + 16 * half, dl, point_lo, delta_lo)
                _put_iq1(dst, y + 16 * half + 8, dl, point_hi, delta_hi)


register_type(IQ2_XXS, "IQ2_XXS", _QK, 66, act_block=_Q8_K)
register_type(IQ2_XS, "IQ2_XS", _QK, 74, act_block=_Q8_K)
register_type(IQ2_S, "IQ2_S", _QK, 82, act_block=_Q8_K)
register_type(IQ3_XXS, "IQ3_XXS", _QK, 98, act_block=_Q8_K)
register_type(IQ3_S, "IQ3_S", _QK, 110, act_block=_Q8_K)
register_type(IQ1_S, "IQ1_S", _QK, 50, act_block=_Q8_K)
register_type(IQ1_M, "IQ1_M", _QK, 56, act_block=_Q8_K)


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def dot_iq2_xs(src, x, xsum32):
    """One IQ2_XS row times float32 x, straight from the blocks: per 256 d / 8 * sum (2 s + 1) value x (the
    decoded row and a float dot had cost 0.27-0.37 ns per weight)."""
    return fdot_iq2_xs_row(_IQ2XS_TABLES, src, x, x.shape[0] // _QK)


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def idot_iq2_xs(src, xq, xd, xs16):
    """One IQ2_XS row times Q8_K activations (ggml's vec_dot_iq2_xs_q8_K): per 16 values the integer dot of
    the signed grid values with the codes times (2 scale + 1), per 256 d * xd / 8."""
    if HAS_AVX512BW and HAS_F16C:
        return fdot_iq2_xs_blocks(_IQ2XS_TABLES, src, xq, xd, xq.shape[0] // _QK)
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // _QK):
        o = b * 74
        isum = idot_iq2_xs_block(_IQ2XS_TABLES, src, o, xq, b * _QK)
        acc += f16(src, o) * xd[b] * np.float32(isum)
    return acc * np.float32(0.125)


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def _xxs_loop(src, xq, xd, size, aux0, aux_step, grid, factor):
    """The integer dot of IQ2_XXS or IQ3_XXS rows (blocks of `size` bytes: fp16 d, then per 32 values ib the grid
    indices at bytes 2 + 8 ib.., its aux word at aux0 + aux_step ib: four 7-bit sign indices through ksigns and
    a 4-bit scale s at bits 28-31) with Q8_K activations, for CPUs without AVX-512BW: per 32 values (2 s + 1) times
    the signed grid values (grid: [points, values a point] int32) dotted with the codes, per 256 d xd factor
    (ggml's vec_dot_iq2_xxs_q8_K, vec_dot_iq3_xxs_q8_K)."""
    n = grid.shape[1]
    per_group = 8 // n  # points per 8 values
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // _QK):
        o = b * size
        isum = 0
        for ib in range(8):
            aux = np.int64(u32(src, o + aux0 + aux_step * ib))
            s = 0
            for l in range(4):
                signs = _KSIGNS[(aux >> (7 * l)) & 127]
                for p in range(per_group):
                    point = src[o + 2 + 8 * ib + per_group * l + p]
                    y = b * _QK + 32 * ib + 8 * l + n * p
                    for j in range(n):
                        s += grid[point, j] * _SIGN8_INT[signs, n * p + j] * np.int32(xq[y + j])
            isum += (2 * (aux >> 28) + 1) * s
        acc += f16(src, o) * xd[b] * np.float32(isum)
    return acc * np.float32(factor)


@numba.njit(nogil=True, cache=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def idot_iq2_xxs_loop(src, xq, xd, xs16):
    """idot_iq2_xxs without AVX-512BW (_xxs_loop): d (0.5 + s) / 4 is d (2 s + 1) / 8."""
    return _xxs_loop(src, xq, xd, 66, 6, 8, _IQ2XXS_INT_GRID, 0.125)


@numba.njit(nogil=True, cache=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def idot_iq3_xxs_loop(src, xq, xd, xs16):
    """idot_iq3_xxs without AVX-512BW (_xxs_loop): d (0.5 + s) / 2 is d (2 s + 1) / 4."""
    return _xxs_loop(src, xq, xd, 98, 66, 4, _IQ3XXS_INT_GRID, 0.25)


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def _s_loop(src, xq, xd, size, grid, high_bits, sign0, scale0, groups_per_scale, factor):
    """The integer dot of IQ2_S or IQ3_S rows with Q8_K activations, for CPUs without AVX-512BW. A block (`size`
    bytes): fp16 d; the grid indices' low bytes at byte 2 + point, their high_bits high bits packed from byte 66
    (8 / high_bits points a byte, the first in the low bits); group g's sign byte at sign0 + g (bit j: value j);
    4-bit scales s from byte scale0, two a byte (low nibble first), one per groups_per_scale groups of 8 values.
    Per run (2 s + 1) times the signed grid values (grid: [points, values a point] int32) dotted with the codes,
    per 256 d xd factor (ggml's vec_dot_iq2_s_q8_K, vec_dot_iq3_s_q8_K)."""
    n = grid.shape[1]
    per_group = 8 // n  # points per 8 values
    per_byte = 8 // high_bits
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // _QK):
        o = b * size
        isum = 0
        for g in range(32):
            signs = src[o + sign0 + g]
            s = 0
            for p in range(per_group):
                i = per_group * g + p
                high = (np.int32(src[o + 66 + i // per_byte]) >> (high_bits * (i % per_byte))) & ((1 << high_bits) - 1)
                point = np.int32(src[o + 2 + i]) | (high << 8)
                y = b * _QK + 8 * g + n * p
                for j in range(n):
                    s += grid[point, j] * _SIGN8_INT[signs, n * p + j] * np.int32(xq[y + j])
            r = g // groups_per_scale
            isum += (2 * ((np.int32(src[o + scale0 + r // 2]) >> (4 * (r % 2))) & 15) + 1) * s
        acc += f16(src, o) * xd[b] * np.float32(isum)
    return acc * np.float32(factor)


@numba.njit(nogil=True, cache=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def idot_iq2_s_loop(src, xq, xd, xs16):
    """idot_iq2_s without AVX-512BW (_s_loop): a scale per 16 values, d (0.5 + s) / 4 is d (2 s + 1) / 8."""
    return _s_loop(src, xq, xd, 82, _IQ2S_INT_GRID, 2, 34, 74, 2, 0.125)


@numba.njit(nogil=True, cache=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def idot_iq3_s_loop(src, xq, xd, xs16):
    """idot_iq3_s without AVX-512BW (_s_loop): a scale per 32 values, d (2 s + 1)."""
    return _s_loop(src, xq, xd, 110, _IQ3S_INT_GRID, 1, 74, 106, 4, 1.0)


@numba.njit(nogil=True, cache=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def idot_iq1_s_loop(src, xq, xd, xs16):
    """idot_iq1_s without AVX-512BW: per 32 values ib (2 s + 1) (8 grid . x +- sum x), per 256 d xd / 8 (ggml's
    vec_dot_iq1_s_q8_K, with its delta of 1/8 taken as the integer 1 against 8 times the grid)."""
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // _QK):
        o = b * 50
        isum = 0
        for ib in range(8):
            qh = np.int32(u16(src, o + 34 + 2 * ib))
            s = 0
            for l in range(4):
                point = np.int32(src[o + 2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)
                for j in range(8):
                    s += _IQ1S_INT_GRID[point, j] * np.int32(xq[b * _QK + 32 * ib + 8 * l + j])
            sum_x = xs16[16 * b + 2 * ib] + xs16[16 * b + 2 * ib + 1]
            isum += (2 * ((qh >> 12) & 7) + 1) * (8 * s + (-sum_x if qh & 0x8000 else sum_x))
        acc += f16(src, o) * xd[b] * np.float32(isum)
    return acc * np.float32(0.125)


@numba.njit(nogil=True, cache=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def idot_iq1_m_loop(src, xq, xd, xs16):
    """idot_iq1_m without AVX-512BW: per 16 values (2 s + 1) times, per 8, 8 grid . x +- sum x; per 256 d xd / 8
    (ggml's vec_dot_iq1_m_q8_K)."""
    acc = np.float32(0.0)
    for b in range(xq.shape[0] // _QK):
        o = b * 56
        s0, s1 = np.int32(u16(src, o + 48)), np.int32(u16(src, o + 50))
        s2, s3 = np.int32(u16(src, o + 52)), np.int32(u16(src, o + 54))
        d = half_to_float((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000))
        isum = 0
        for g in range(32):
            r = g // 2  # run of 16
            qh = np.int32(src[o + 32 + g // 2]) >> (4 * (g % 2))
            point = np.int32(src[o + g]) | ((qh & 7) << 8)
            s = 0
            sum_x = 0
            for j in range(8):
                x = np.int32(xq[b * _QK + 8 * g + j])
                s += _IQ1S_INT_GRID[point, j] * x
                sum_x += x
            ls = 2 * ((np.int32(u16(src, o + 48 + 2 * (r // 4))) >> (3 * (r % 4))) & 7) + 1
            isum += ls * (8 * s + (-sum_x if qh & 8 else sum_x))
        acc += d * xd[b] * np.float32(isum)
    return acc * np.float32(0.125)


def _grid_row_dots(points, int_blocks, float_row, loop):
    """The float (src, x, xsum32) and integer (src, xq, xd, xs16) row dots of an i-quant read a point at a time
    (simd._iq2_dots' dots over the grid `points`), the integer one by its portable loop without AVX-512BW."""
    @numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
    def dot(src, x, xsum32):
        return float_row(points, src, x, x.shape[0] // _QK)

    @numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
    def idot(src, xq, xd, xs16):
        if HAS_AVX512BW and HAS_F16C:
            return int_blocks(points, src, xq, xd, xq.shape[0] // _QK)
        return loop(src, xq, xd, xs16)
    return dot, idot


dot_iq2_xxs, idot_iq2_xxs = _grid_row_dots(_IQ2XXS_POINTS, fdot_iq2_xxs_blocks, fdot_iq2_xxs_row, idot_iq2_xxs_loop)
dot_iq3_xxs, idot_iq3_xxs = _grid_row_dots(_IQ3XXS_POINTS, fdot_iq3_xxs_blocks, fdot_iq3_xxs_row, idot_iq3_xxs_loop)
dot_iq2_s, idot_iq2_s = _grid_row_dots(_IQ2S_POINTS, fdot_iq2_s_blocks, fdot_iq2_s_row, idot_iq2_s_loop)
dot_iq3_s, idot_iq3_s = _grid_row_dots(_IQ3S_POINTS, fdot_iq3_s_blocks, fdot_iq3_s_row, idot_iq3_s_loop)
dot_iq1_s, idot_iq1_s = _grid_row_dots(_IQ1S_POINTS, fdot_iq1_s_blocks, fdot_iq1_s_row, idot_iq1_s_loop)
dot_iq1_m, idot_iq1_m = _grid_row_dots(_IQ1S_POINTS, fdot_iq1_m_blocks, fdot_iq1_m_row, idot_iq1_m_loop)
