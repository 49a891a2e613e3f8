"""Mixture-of-Experts: routing and the one dispatch point where selected experts are computed.

``route_softmax_topk`` turns router logits into each token's experts and weights. ``moe_ffn`` takes a
layer's expert weights, the hidden states and those choices, groups the tokens by expert, runs each
selected expert's SwiGLU through the device (the experts with a few tokens all in one grouped call, each
busier expert on its own 2-D slices), and sums the weighted results (plus the shared expert, if the layer
has one). ``moe_layer`` is the whole block: routing, then ``moe_ffn``; a single token (decode) goes to the
device's fused call instead, router, top-k, shared and routed experts in one compiled call with no per-expert
Python (or, where the device has no fused path for the tensors' types, to its expert pool: all the selected
experts in one call, the shared expert in a second). Deciding where each expert runs is this module's business
alone: architecture files only call ``moe_layer`` (or ``moe_ffn`` with routing of their own).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from strata_async.kernels.expert_pool import add_scaled_rows
from strata_async.kernels.routing import softmax_topk

from .device import Device
from .layers import sigmoid, swiglu
from .weights import QTensor


# Experts with up to this many tokens of a prompt chunk go to the device's grouped call (one parallel call for
# all of them, each expert's rows decoded into tiles once and multiplied with its tokens); busier experts are
# matrix products of their own (BLAS tiles, a Python call per projection). 512-token prompts of the synthetic
# 80B files, 2 threads: 64 against 16 took Q8_0 (real routing, ~10 tokens per expert, dozens above 16) from
# 4.3-4.5 to 3.8-4.3 s and Q4_K (a few experts with every token) from 2.5-2.7 to 2.3-2.5 s; 512 (all grouped)
# was slower on Q4_K (3.2-3.5 s), where BLAS is faster for the experts with every token.
GROUPED_TOKENS_MAX = 64


@dataclass(frozen=True)
class RoutedExperts:
    gate: QTensor  # [n_experts, expert_ffn, hidden]
    up: QTensor  # [n_experts, expert_ffn, hidden]
    down: QTensor  # [n_experts, hidden, expert_ffn]


@dataclass(frozen=True)
class SharedExpert:
    gate: QTensor  # [shared_ffn, hidden]
    up: QTensor  # [shared_ffn, hidden]
    down: QTensor  # [hidden, shared_ffn]
    gate_inp: QTensor | None  # [1, hidden]: the output is scaled by sigmoid(gate_inp . x); None: unscaled

    @cached_property
    def as_pool(self) -> tuple[QTensor, QTensor, QTensor]:
        """gate, up and down as 3-D expert tensors of one expert (views), for the device's expert pool."""
        return _as_pool(self.gate), _as_pool(self.up), _as_pool(self.down)


def route_softmax_topk(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over experts, keep the k largest per token, optionally renormalised to sum to 1.

    logits [n, n_experts] -> (expert ids [n, k] int64, weights [n, k] float32), largest first (one kernel call).
    """
    return softmax_topk(logits, k, normalize)


def _moe_decode(dev: Device, x: np.ndarray, experts: RoutedExperts, ids: np.ndarray, weights: np.ndarray,
                shared: SharedExpert | None, out: np.ndarray) -> bool:
    """One token: the selected experts and the shared expert each in one device call (the expert pool).
    Returns False, out untouched, where the device has no pooled path."""
    if not dev.swiglu_experts(x[0], experts.gate, experts.up, experts.down, ids[0], weights[0], out):
        return False
    if shared is not None:
        scale = _UNSCALED if shared.gate_inp is None else sigmoid(dev.linear(x, shared.gate_inp))[0]
        dev.swiglu_experts(x[0], *shared.as_pool, _EXPERT_0, scale, out)
    return True


# The shared expert's arguments to the pool: expert 0 of its one-expert view, weight 1 (read, never written).
_EXPERT_0 = np.zeros(1, np.int64)
_UNSCALED = np.ones(1, np.float32)


def _as_pool(w: QTensor) -> QTensor:
    """A 2-D matrix as a 3-D expert tensor of one expert (a view)."""
    return QTensor(w.name, w.ggml_type, (1, *w.shape), w.data.reshape(1, *w.data.shape))


def moe_layer(dev: Device, x: np.ndarray, router: QTensor, k: int, normalize: bool, experts: RoutedExperts,
              shared: SharedExpert | None = None) -> np.ndarray:
    """A layer's MoE block on x [n, hidden]: each token's k most probable experts by the router's softmax
    (renormalised over the k where normalize), their weighted SwiGLU outputs summed (+ the gated shared expert)."""
    if x.shape[0] == 1:
        fused = dev.moe_token(x[0], router, k, normalize, (experts.gate, experts.up, experts.down),
                              None if shared is None else (shared.gate, shared.up, shared.down),
                              None if shared is None else shared.gate_inp)
        if fused is not None:
            return fused[0][None, :]
    ids, weights = route_softmax_topk(dev.linear(x, router), k, normalize)
    return moe_ffn(dev, x, experts, ids, weights, shared)


def moe_ffn(dev: Device, x: np.ndarray, experts: RoutedExperts, ids: np.ndarray, weights: np.ndarray,
            shared: SharedExpert | None = None) -> np.ndarray:
    """sum_j weights[:, j] * expert_{ids[:, j]}(x) (+ the gated shared expert); x [n, hidden] -> [n, hidden]."""
    n, k = ids.shape
    out = np.zeros_like(x)
    if n == 1 and _moe_decode(dev, x, experts, ids, weights, shared, out[0]):
        return out
    # Sort the (token, slot) pairs by expert: each expert then sees one contiguous group of tokens.
    flat = ids.reshape(-1)
    flat_weights = weights.reshape(-1)
    order = np.argsort(flat, kind="stable")
    expert_of, starts = np.unique(flat[order], return_index=True)
    ends = np.append(starts[1:], len(order))
    # Experts with a few tokens (most of them, in a prompt chunk of a many-expert model) go to the device in one
    # grouped call; an expert with many tokens is a matrix product of its own (BLAS tiles).
    few = (ends - starts) <= GROUPED_TOKENS_MAX
    if few.any():
        pairs = np.concatenate([order[a:b] for a, b in zip(starts[few].tolist(), ends[few].tolist())])
        group_starts = np.concatenate([[0], np.cumsum(ends[few] - starts[few])])
        y = dev.swiglu_experts_grouped(x, experts.gate, experts.up, experts.down, pairs // k, expert_of[few],
                                       group_starts)
        if y is None:
            few[:] = False
        else:
            add_scaled_rows(out, pairs // k, y, flat_weights[pairs])
    for e, start, end in zip(expert_of[~few].tolist(), starts[~few].tolist(), ends[~few].tolist()):
        pairs = order[start:end]
        tokens = pairs // k  # distinct: a token picks an expert at most once
        y = swiglu(dev, x[tokens], experts.gate.expert(e), experts.up.expert(e), experts.down.expert(e))
        add_scaled_rows(out, tokens, y, flat_weights[pairs])
    if shared is not None:
        y = swiglu(dev, x, shared.gate, shared.up, shared.down)
        scale = np.ones(n, np.float32) if shared.gate_inp is None else sigmoid(dev.linear(x, shared.gate_inp))[:, 0]
        add_scaled_rows(out, np.arange(n), y, scale)
    return out
