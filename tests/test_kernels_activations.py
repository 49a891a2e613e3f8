"""Element-wise activation kernels against float64 numpy (and torch's float32 functions for the edge cases).

Errors are counted in units in the last place of the float32 result (ulp): the vectorized exp is within 1 ulp of
the float64 exp over its whole range, sigmoid and SiLU within 4 (float32 arithmetic after it: one add, one
divide, one multiply; numpy's own float32 sigmoid measured 3.2 here). Below exp(-87) values are flushed to 0,
an absolute error under 1.7e-38.
"""

import numba
import numpy as np
import pytest
import torch

from strata_async.kernels import activations

EXP_ULP = 1.0
ACT_ULP = 4.0
TINY = 1.7e-38  # exp(-87): the smallest value the kernels return instead of 0


def ulp_error(got: np.ndarray, want64: np.ndarray) -> np.ndarray:
    """|got - want| in units of float32's spacing at want (where |want| is above TINY)."""
    keep = np.abs(want64) > TINY
    return np.abs(got[keep].astype(np.float64) - want64[keep]) / np.spacing(np.abs(want64[keep]).astype(np.float32))


@numba.njit(fastmath=activations.ELEMENTWISE_MATH)
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = activations.exp_nonpositive(x[i])


def _inputs(rng) -> np.ndarray:
    """A dense sweep of -100..100 plus random values, zeros and the points around the flush threshold."""
    return np.concatenate([np.linspace(-100, 100, 400_001), rng.standard_normal(10_000) * 8,
                           [0.0, -0.0, -87.0, -86.99, -87.01, 1e-8, -1e-8, 1e-39, 88.0, 200.0]]).astype(np.float32)


def test_exp_within_one_ulp_and_flushed_below_minus_87():
    x = np.concatenate([np.linspace(-87, 0, 1_000_001), [-0.0, -1e-30, -87.0]]).astype(np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    assert ulp_error(out, np.exp(x.astype(np.float64))).max() <= EXP_ULP
    assert out[-3] == 1.0 and out[-2] == 1.0
    below = np.array([-87.01, -100.0, -1e4, -np.inf], np.float32)
    out = np.empty_like(below)
    _exp_all(below, out)
    np.testing.assert_array_equal(out, 0.0)


def test_sigmoid_and_silu_match_float64(rng):
    x = _inputs(rng)
    x64 = x.astype(np.float64)
    sig64 = 1.0 / (1.0 + np.exp(-x64))
    assert ulp_error(activations.sigmoid(x), sig64).max() <= ACT_ULP
    # SiLU: x * exp(x) for x < -87 is flushed with its sigmoid (|error| < 100 * 1.7e-38 over this sweep)
    normal = x > -87
    silu = activations.silu(x)
    assert ulp_error(silu[normal], (x64 * sig64)[normal]).max() <= ACT_ULP
    assert np.abs(silu[~normal] - (x64 * sig64)[~normal]).max() <= 100 * TINY
    assert np.abs(activations.sigmoid(x) - sig64)[~normal].max() <= TINY


def test_two_operand_kernels_match_float64(rng):
    g = _inputs(rng)[:410_000].reshape(-1, 10)
    u = rng.standard_normal(g.shape).astype(np.float32) * 4
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    sig64 = 1.0 / (1.0 + np.exp(-g64))
    got = activations.silu_mul(g, u)
    assert got.shape == g.shape and got.dtype == np.float32
    # one more float32 product on top of silu: one more rounding
    normal = g > -87
    assert ulp_error(got[normal], (g64 * sig64 * u64)[normal]).max() <= ACT_ULP + 1
    flushed = ~normal  # there silu(g) * u is within |g u| * 1.7e-38 of 0
    assert np.all(np.abs(got[flushed] - (g64 * sig64 * u64)[flushed]) <= np.abs(g64 * u64)[flushed] * TINY)
    got = activations.mul_sigmoid(u, g)
    assert got.shape == g.shape
    assert ulp_error(got[normal], (u64 * sig64)[normal]).max() <= ACT_ULP + 1
    assert np.all(np.abs(got[flushed] - (u64 * sig64)[flushed]) <= np.abs(u64)[flushed] * TINY)


def test_special_values_as_torch():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 50.0, -50.0], np.float32)
    t = torch.from_numpy(x)
    np.testing.assert_array_equal(activations.sigmoid(x), torch.sigmoid(t).numpy())
    want = torch.nn.functional.silu(t).numpy()
    got = activations.silu(x)
    # torch's silu(-inf) is -inf * 0 = nan, as ours; -50 * exp(-50) agrees to a few ulp
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-6, atol=0)


def test_shapes_strides_and_bad_input(rng):
    x = rng.standard_normal((6, 8)).astype(np.float32)
    view = x[:, ::2]  # not contiguous: taken through a copy
    np.testing.assert_array_equal(activations.sigmoid(view), activations.sigmoid(np.ascontiguousarray(view)))
    assert activations.silu(x[:0]).shape == (0, 8)
    with pytest.raises(ValueError, match="float32"):
        activations.sigmoid(x.astype(np.float64))
    with pytest.raises(ValueError, match="differ in shape"):
        activations.silu_mul(x, x[:3])
    with pytest.raises(ValueError, match="differ in shape"):
        activations.mul_sigmoid(x, x.T.copy())
