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
def _bits(n, q, qo, shift, mask, x, xo):
    if n == 16:
        return simd.idot_bits_16(q, qo, shift, mask, x, xo)
    return simd.idot_bits_32(q, qo, shift, mask, x, xo)


@numba.njit
def _q6(ql, lo, lshift, qh, ho, hshift, x, xo):
    return simd.idot_q6_16(ql, lo, lshift, qh, ho, hshift, x, xo)


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


def test_idot_bits(rng):
    q, x = _bytes(rng, 100), _bytes(rng, 100).view(np.int8)
    for n in (16, 32):
        for shift, mask in [(0, 15), (4, 15), (0, 3), (2, 3), (4, 3), (6, 3), (0, 255)]:
            for qo, xo in [(0, 0), (5, 33), (64, 1)]:
                codes = (q[qo:qo + n].astype(np.int64) >> shift) & mask
                want = int(np.dot(codes, x[xo:xo + n].astype(np.int64)))
                assert _bits(n, q, qo, shift, mask, x, xo) == want, (n, shift, mask, qo, xo)


def test_idot_q6_16(rng):
    ql, qh, x = _bytes(rng, 80), _bytes(rng, 80), _bytes(rng, 80).view(np.int8)
    for lshift in (0, 4):
        for hshift in (0, 2, 4, 6):
            for lo, ho, xo in [(0, 0, 0), (7, 31, 50), (64, 3, 9)]:
                codes = ((ql[lo:lo + 16].astype(np.int64) >> lshift) & 15) | (
                    ((qh[ho:ho + 16].astype(np.int64) >> hshift) & 3) << 4)
                want = int(np.dot(codes, x[xo:xo + 16].astype(np.int64)))
                assert _q6(ql, lo, lshift, qh, ho, hshift, x, xo) == want


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
