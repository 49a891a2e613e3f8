"""The row-wise kernels' two forms: serial for a decoded token's few rows, rows split over the threads for a prompt
chunk (activations.by_size). Both must give the float64 references' results and the same bits as each other; the
form is forced here by moving the size threshold, at prompt-chunk shapes and at the shapes of short rows."""

import numpy as np
import pytest
from assets import randn

from strata_async.kernels import activations
from strata_async.kernels.attention import rope
from strata_async.kernels.deltanet import causal_conv1d
from strata_async.kernels.norms import gated_rmsnorm, l2norm, rmsnorm, rmsnorm_heads
from strata_async.kernels.reference import causal_conv1d_ref, gated_rmsnorm_ref, l2norm_ref, rmsnorm_ref, rope_ref

F64_TOL = 2e-6


def both_forms(monkeypatch, call):
    """call() with every row kernel serial, then with every one parallel."""
    monkeypatch.setattr(activations, "PARALLEL_VALUES", 1 << 62)
    serial = call()
    monkeypatch.setattr(activations, "PARALLEL_VALUES", 0)
    parallel = call()
    return serial, parallel


@pytest.mark.parametrize("n, d", [(512, 2048), (3, 37)])
def test_rmsnorm_forms(monkeypatch, rng, n, d):
    x, w = randn(rng, n, d, scale=3.0), randn(rng, d)
    serial, parallel = both_forms(monkeypatch, lambda: rmsnorm(x, w, 1e-6))
    np.testing.assert_array_equal(serial, parallel)
    np.testing.assert_allclose(parallel, rmsnorm_ref(x, w, 1e-6), rtol=0, atol=F64_TOL * 3)


@pytest.mark.parametrize("n, h, d", [(256, 16, 256), (2, 3, 20)])
def test_rmsnorm_heads_forms(monkeypatch, rng, n, h, d):
    x, w = randn(rng, n, h, d), randn(rng, d)
    serial, parallel = both_forms(monkeypatch, lambda: rmsnorm_heads(x, w, 1e-6))
    np.testing.assert_array_equal(serial, parallel)
    np.testing.assert_allclose(parallel, rmsnorm_ref(x, w, 1e-6), rtol=0, atol=F64_TOL * 2)


@pytest.mark.parametrize("n, h, d", [(512, 32, 128), (3, 2, 9)])
def test_gated_rmsnorm_and_l2norm_forms(monkeypatch, rng, n, h, d):
    x, gate, w = randn(rng, n, h, d), randn(rng, n, h, d, scale=4.0), randn(rng, d)
    serial, parallel = both_forms(monkeypatch, lambda: gated_rmsnorm(x, gate, w, 1e-6))
    np.testing.assert_array_equal(serial, parallel)
    np.testing.assert_allclose(parallel, gated_rmsnorm_ref(x, gate, w, 1e-6), rtol=F64_TOL, atol=F64_TOL * 4)
    x[0, 0] *= 1e-4  # a tiny vector, where eps shows
    serial, parallel = both_forms(monkeypatch, lambda: l2norm(x))
    np.testing.assert_array_equal(serial, parallel)
    np.testing.assert_allclose(parallel, l2norm_ref(x), rtol=0, atol=F64_TOL)


@pytest.mark.parametrize("n, h, d, rot_dim", [(512, 16, 256, 64), (3, 2, 32, 32)])
def test_rope_forms(monkeypatch, rng, n, h, d, rot_dim):
    x = randn(rng, n, h, d)
    positions = np.arange(100, 100 + n, dtype=np.int64)
    serial, parallel = both_forms(monkeypatch, lambda: rope(x, positions, 1e7, rot_dim))
    np.testing.assert_array_equal(serial, parallel)
    np.testing.assert_allclose(parallel, rope_ref(x, positions, 1e7, rot_dim), rtol=0, atol=F64_TOL)
    np.testing.assert_array_equal(parallel[..., rot_dim:], x[..., rot_dim:])


@pytest.mark.parametrize("n, channels, kernel", [(512, 8192, 4), (2, 10, 4), (5, 16, 2)])
def test_causal_conv1d_forms(monkeypatch, rng, n, channels, kernel):
    x, weight, state = randn(rng, n, channels), randn(rng, channels, kernel, scale=0.5), randn(rng, kernel - 1, channels)
    states = []

    def call():
        s = state.copy()
        out = causal_conv1d(x, s, weight)
        states.append(s)
        return out

    serial, parallel = both_forms(monkeypatch, call)
    np.testing.assert_array_equal(serial, parallel)
    np.testing.assert_array_equal(states[0], states[1])
    ref_out, ref_state = causal_conv1d_ref(x, state, weight)
    np.testing.assert_allclose(parallel, ref_out, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(states[1], ref_state)
