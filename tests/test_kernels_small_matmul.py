"""The small in-kernel matrix products against float64 numpy.

Inputs are fresh each run (the seed is printed). Tolerance: |error| <= 2e-6 * sum_i |a_ti b_ji| (float32
rounding of sums of up to a few thousand products in several orders).
"""

import numba
import numpy as np
import pytest
from assets import randn

from strata_async.kernels.small_matmul import matmul_nn, matmul_nt, matmul_nt_at, matmul_nt_regs

REL_TOL = 2e-6


def assert_close(got: np.ndarray, a: np.ndarray, b: np.ndarray, c0: np.ndarray | None) -> None:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = a64 @ b64.T + (0.0 if c0 is None else c0.astype(np.float64))
    scale = np.abs(a64) @ np.abs(b64).T + (0.0 if c0 is None else np.abs(c0.astype(np.float64)))
    assert np.all(np.abs(got - want) <= REL_TOL * scale + 1e-30), np.max(np.abs(got - want) / (scale + 1e-30))


# Edges of the 4 x 4 register blocks (m, n of 1-3 past a multiple of 4), k below, at and past the 16 lanes and
# the 512-long chunks, and the shapes of the grouped prompt experts (a dozen tokens, 16 rows, 2048 inputs).
SHAPES = [(1, 1, 1), (1, 1, 16), (3, 5, 17), (4, 4, 32), (5, 6, 100), (7, 9, 513), (8, 12, 1040), (11, 16, 2048),
          (13, 3, 64), (2, 7, 0)]


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_nt_regs_against_float64(rng, m, n, k, accumulate):
    a, b = randn(rng, m, k), randn(rng, n, k)
    c0 = randn(rng, m, n)
    c = c0.copy()
    matmul_nt_regs(a, b, c, m, n, k, accumulate)
    assert_close(c, a, b, c0 if accumulate else None)
    if k:  # the plain loop agrees too (same function, another blocking)
        c2 = c0.copy()
        matmul_nt(a, b, c2, m, n, k, accumulate)
        assert_close(c2, a, b, c0 if accumulate else None)


# matmul_nn's blocks: 4 rows x 64 columns, edges of 1 row and 16 columns, then the last n % 16 columns one by one;
# the DeltaNet chunk's shapes (64 tokens, 128 keys and values) among them.
NN_SHAPES = [(1, 1, 1), (1, 16, 3), (3, 17, 5), (4, 64, 128), (5, 80, 64), (7, 100, 33), (64, 128, 128),
             (64, 64, 128), (128, 128, 64), (9, 130, 0)]


@pytest.mark.parametrize("m, n, k", NN_SHAPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_nn_against_float64(rng, m, n, k, accumulate):
    a, b = randn(rng, m, k), randn(rng, k, n)
    c0 = randn(rng, m, n)
    c = c0.copy()
    matmul_nn(a, b, c, m, n, k, accumulate)
    assert_close(c, a, np.ascontiguousarray(b.T), c0 if accumulate else None)


def test_matmul_nn_writes_only_its_block(rng):
    # a product smaller than its arrays: C's other entries are left as they were, A's and B's others not read
    a, b = randn(rng, 10, 40), randn(rng, 40, 90)
    c = randn(rng, 12, 96)
    before = c.copy()
    a[6:] = np.nan
    b[33:] = np.nan
    m, n, k = 6, 70, 33
    matmul_nn(a, b, c, m, n, k, False)
    assert_close(c[:m, :n], a[:m, :k], np.ascontiguousarray(b[:k, :n].T), None)
    outside = np.ones_like(c, bool)
    outside[:m, :n] = False
    np.testing.assert_array_equal(c[outside], before[outside])


def test_matmul_nt_at_addresses_a_window_of_larger_arrays(rng):
    # A = rows 3..8 of a [10, 40] array from column 5, B = rows 2..8 of [9, 48] from column 7, k = 33; C written at
    # rows 1.. and column 4 of a [8, 12] array, nothing else of it touched
    big_a, big_b = randn(rng, 10, 40), randn(rng, 9, 48)
    c = randn(rng, 8, 12)
    before = c.copy()
    m, n, k = 6, 7, 33
    matmul_nt_at(big_a, 3 * 40 + 5, 40, big_b, 2 * 48 + 7, 48, c, 1 * 12 + 4, 12, m, n, k, False)
    assert_close(c[1:1 + m, 4:4 + n], big_a[3:3 + m, 5:5 + k], big_b[2:2 + n, 7:7 + k], None)
    outside = np.ones_like(c, bool)
    outside[1:1 + m, 4:4 + n] = False
    np.testing.assert_array_equal(c[outside], before[outside])


def test_matmul_nt_regs_on_row_slices_inside_a_kernel(rng):
    # how the grouped expert calls use it: row slices of C-contiguous arrays, compiled code calling compiled code
    @numba.njit
    def grouped(x, tile, out, p0, p1):
        matmul_nt_regs(x[p0:p1], tile, out, p1 - p0, tile.shape[0], x.shape[1], False)

    x, tile = randn(rng, 30, 256), randn(rng, 16, 256)
    out = np.empty((9, 16), np.float32)
    grouped(x, tile, out, 11, 20)
    assert_close(out, x[11:20], tile, None)
