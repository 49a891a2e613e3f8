"""The routing kernel against transformers' routing (torch softmax, topk, renormalisation) and float64 numpy.

Inputs are fresh each run (the seed is printed). Weights within 2e-6 relative of the float64 softmax.
"""

import numpy as np
import pytest
import torch
from assets import randn

from strata_async.kernels.routing import softmax_topk


def torch_routing(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """What transformers' Qwen3-MoE / Qwen3-Next sparse blocks do with the router logits."""
    probs = torch.softmax(torch.from_numpy(logits), dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.numpy(), weights.numpy()


def float64_weights(logits: np.ndarray, ids: np.ndarray, normalize: bool) -> np.ndarray:
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    w = np.take_along_axis(p, ids, axis=-1)
    return w / w.sum(axis=-1, keepdims=True) if normalize else w


@pytest.mark.parametrize("n, experts, k", [(1, 512, 10), (7, 16, 4), (64, 128, 8), (3, 5, 5), (2, 40, 1)])
@pytest.mark.parametrize("normalize", [True, False])
def test_routing_matches_transformers(rng, n, experts, k, normalize):
    logits = randn(rng, n, experts, scale=float(rng.uniform(0.5, 8.0)))
    ids, weights = softmax_topk(logits, k, normalize)
    assert ids.dtype == np.int64 and weights.dtype == np.float32 and ids.shape == weights.shape == (n, k)
    want_ids, want_weights = torch_routing(logits, k, normalize)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-12)
    np.testing.assert_allclose(weights, float64_weights(logits, ids, normalize), rtol=2e-6, atol=1e-12)


def test_equal_probabilities_keep_the_lower_expert_first():
    logits = np.array([[0.0, 3.0, 1.0, 3.0, 1.0, 3.0]], np.float32)
    ids, weights = softmax_topk(logits, 4, False)
    np.testing.assert_array_equal(ids, [[1, 3, 5, 2]])  # a stable sort of -p
    assert weights[0, 0] == weights[0, 1] == weights[0, 2] > weights[0, 3]


def test_nan_logits_still_name_real_experts():
    logits = np.full((1, 8), np.nan, np.float32)
    ids, weights = softmax_topk(logits, 3, True)
    assert np.all((ids >= 0) & (ids < 8)) and np.all(np.isnan(weights))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="k must be between 1"):
        softmax_topk(np.zeros((1, 4), np.float32), 5, True)
    with pytest.raises(ValueError, match="dtype float32"):
        softmax_topk(np.zeros((1, 4), np.float64), 2, True)
    with pytest.raises(ValueError, match="shape"):
        softmax_topk(np.zeros(4, np.float32), 2, True)
