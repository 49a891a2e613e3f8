"""Mixture-of-Experts routing: softmax over a token's router logits, its k most probable experts, their weights.

One kernel call per batch of tokens instead of a dozen numpy calls (max, subtract, exp, sum, divide, argsort,
take_along_axis, renormalise, ...), which had cost a decoded token more than the routing arithmetic itself.
"""

from __future__ import annotations

import numba
import numpy as np

from .activations import ELEMENTWISE_MATH, exp_nonpositive
from .checks import require_array


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy")
def _softmax_topk(logits, normalize, probs, ids, weights):
    n, n_experts = logits.shape
    k = ids.shape[1]
    for t in range(n):
        row = logits[t]
        m = row[0]
        for e in range(1, n_experts):
            m = max(m, row[e])
        total = np.float32(0.0)
        for e in range(n_experts):
            p = exp_nonpositive(row[e] - m)
            probs[e] = p
            total += p
        # the k largest, largest first; an equal value never displaces an earlier expert (a stable sort's order)
        best = weights[t]
        chosen = ids[t]
        for e in range(n_experts):
            p = probs[e] / total
            filled = min(e, k)
            if filled == k and not p > best[k - 1]:
                continue
            j = filled if filled < k else k - 1
            while j > 0 and p > best[j - 1]:  # shift the smaller ones down (the last of k falls off)
                best[j] = best[j - 1]
                chosen[j] = chosen[j - 1]
                j -= 1
            best[j] = p
            chosen[j] = e
        if normalize:
            s = np.float32(0.0)
            for j in range(k):
                s += best[j]
            for j in range(k):
                best[j] = best[j] / s


def softmax_topk(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """logits float32 [n, n_experts] -> (expert ids int64 [n, k], weights float32 [n, k]), most probable first.

    Weights are softmax probabilities (float32, max-subtracted), divided by their sum over the k when
    ``normalize``. Equal probabilities keep the lower expert number first.
    """
    logits = require_array("logits", np.ascontiguousarray(logits), (None, None))
    n, n_experts = logits.shape
    if not 1 <= k <= n_experts:
        raise ValueError(f"k must be between 1 and the number of experts ({n_experts}), got {k}")
    ids = np.empty((n, k), np.int64)
    weights = np.empty((n, k), np.float32)
    _softmax_topk(logits, bool(normalize), np.empty(n_experts, np.float32), ids, weights)
    return ids, weights
