"""The tile threads of prompt products: every share runs once, errors come back, results do not depend on the
thread count (each tile is one single-threaded BLAS product, whichever thread computes it)."""

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from strata_async.kernels import quant, tile_threads


@pytest.fixture
def two_threads():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 Numba threads")
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    yield
    numba.set_num_threads(before)


def test_every_part_runs_once(two_threads):
    seen = []
    tile_threads.run_parts(lambda part, parts: seen.append((part, parts)))
    assert sorted(seen) == [(0, 2), (1, 2)]


def test_errors_of_pool_parts_are_raised(two_threads):
    def work(part, parts):
        if part == 1:
            raise RuntimeError("tile failed")

    with pytest.raises(RuntimeError, match="tile failed"):
        tile_threads.run_parts(work)


def test_matmul_same_for_one_and_two_threads(rng, two_threads):
    from gguf import quants

    w = rng.standard_normal((300, 512)).astype(np.float32)  # 3 tiles: one thread takes two
    raw = quants.quantize(w, T.Q8_0)
    x = rng.standard_normal((40, 512)).astype(np.float32)
    got2 = quant.matmul(raw, int(T.Q8_0), x)
    numba.set_num_threads(1)
    got1 = quant.matmul(raw, int(T.Q8_0), x)
    np.testing.assert_array_equal(got1, got2)
    want = x.astype(np.float64) @ quant.dequantize(raw, int(T.Q8_0), w.shape).astype(np.float64).T
    np.testing.assert_allclose(got2, want, rtol=0, atol=1e-3)
