"""The vector building blocks of the integer dots (kernels/simd.py) against numpy, on random bytes.

Every function is exact integer arithmetic (or an exact half -> float conversion), so results must be equal,
not close. Offsets are odd and the byte values cover the extremes (0, 127, 128, 255) that sign or zero
extension gets wrong.
"""

import numba
import numpy as np

from strata_async.kernels import ggml_blocks, simd


@numba.njit
def _s8_32(a, ao, x, xo):
    return simd.idot_s8_32(a, ao, x, xo)


@numba.njit
def _f16_all(src, out):
    for i in range(out.shape[0]):
        out[i] = ggml_blocks.f16(src, 2 * i)


def _bytes(rng, n):
    b = rng.integers(0, 256, n, dtype=np.uint8)
    b[:4] = (0, 127, 128, 255)
    return b


def test_idot_s8_32(rng):
    a, x = _bytes(rng, 200), _bytes(rng, 200).view(np.int8)
    for ao, xo in [(0, 0), (3, 17), (150, 101), (168, 168)]:
        want = int(np.dot(a[ao:ao + 32].view(np.int8).astype(np.int64), x[xo:xo + 32].astype(np.int64)))
        assert _s8_32(a, ao, x, xo) == want
    assert _s8_32(np.full(32, 128, np.uint8), 0, np.full(32, -128, np.int8), 0) == 32 * 128 * 128  # no int16 wrap


def test_f16_every_half():
    """All 65536 halves (subnormals, infinities, NaNs) convert exactly, at unaligned offsets too."""
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    src = np.zeros(2 * 65536 + 1, np.uint8)
    src[1:] = halves.view(np.uint8)
    out = np.empty(65536, np.float32)
    _f16_all(src[1:], out)
    want = halves.astype(np.float32)
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(out[finite], want[finite])
    assert np.isnan(out[~finite]).all()
    np.testing.assert_array_equal(np.signbit(out[finite]), np.signbit(want[finite]))


@numba.njit
def _q6_half(src, ql, qh, sc, x, xo):
    return simd.idot_q6_half(src, ql, qh, sc, x, xo)


def test_idot_q6_half(rng):
    """Against the Q6_K layout written out: value (l, k) of the half takes its low nibble from
    ql[l + 32 (k % 2)] (bits 4 k // 2 ...), its high bits from qh[l] >> 2 k, its scale from sc[2 k + l // 16],
    and is (code - 32) times the scale."""
    src, x = _bytes(rng, 300), _bytes(rng, 300).view(np.int8)
    for ql, qh, sc, xo in [(0, 64, 96, 0), (5, 100, 290, 37), (150, 214, 246, 172)]:
        want = 0
        for k in range(4):
            for l in range(32):
                low = (int(src[ql + l + 32 * (k % 2)]) >> (4 * (k // 2))) & 15
                code = low | (((int(src[qh + l]) >> (2 * k)) & 3) << 4)
                scale = int(src[sc + 2 * k + l // 16].astype(np.int8))
                want += scale * (code - 32) * int(x[xo + 32 * k + l])
        assert _q6_half(src, ql, qh, sc, x, xo) == want


@numba.njit
def _grid8x4(grid, signs, q, qo, sc_lo, sc_hi, x, xo):
    return simd.idot_grid8x4(grid, signs, q, qo, sc_lo, sc_hi, x, xo)


def test_idot_grid8x4(rng):
    """IQ2_XS's packed groups against gguf's grid and sign tables, decoded here in numpy."""
    from gguf import quants
    from strata_async.kernels import quant, quant_iq  # noqa: F401 - quant first: it loads the formats in order

    quants.IQ2_XS.init_grid()
    grid = quants.IQ2_XS.grid.reshape(512, 8).astype(np.int64)
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8)
    q = rng.integers(0, 65536, 40, dtype=np.uint16)
    q[:4] = (0, 511, 65535, 512)
    qb, x = q.view(np.uint8), _bytes(rng, 100).view(np.int8)
    for qo, xo, sc_lo, sc_hi in [(0, 0, 1, 31), (8, 13, 17, 3), (62, 60, 31, 31)]:
        want = 0
        for g in range(4):
            code = int(qb[qo + 2 * g]) | (int(qb[qo + 2 * g + 1]) << 8)
            sign_bits = int(ksigns[code >> 9])
            for j in range(8):
                v = int(grid[code & 511, j]) * (-1 if (sign_bits >> j) & 1 else 1)
                want += (sc_lo if g < 2 else sc_hi) * v * int(x[xo + 8 * g + j])
        assert _grid8x4(quant_iq._IQ2XS_GRID64, quant_iq._KSIGNS64, qb, qo, sc_lo, sc_hi, x, xo) == want
