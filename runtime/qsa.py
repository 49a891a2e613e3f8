"""QSA: query-selected sparse attention (qwen4exp's indexed-attention layers).

A light indexer picks, for every query, which past positions the layer's attention may look at:

    q_i   = rope(rmsnorm(W_iq x) per head)                     [n, index_heads, index_dim] at the query's position
    raw_t = W_ik x_t                                           one raw index key per position (cached)
    key_b = rope(rmsnorm(mean(raw_t for t in block b)))        block b = positions [b r, (b + 1) r), r = compress
                                                               ratio; roped at the block's first position
    score = sum over heads of relu(q_i . key_b) / sqrt(index_dim)

Query t sees the blocks complete at t, (t + 1) // r of them; it keeps the budget // r best-scoring ones (all
of them if there are no more) plus every position of its own partial block, itself included. That is
transformers' Qwen4Exp (the reference of record): llama.cpp 0.3.36 instead always keeps budget + r - 1
positions, topping up from the next-best block, and so disagrees once r > 1. Attention then runs over the
kept positions only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .device import Device
from .layers import linear, rmsnorm, rope
from .state import IndexedKVCache
from .weights import QTensor, WeightStore


@dataclass(frozen=True)
class QSAShape:
    n_heads: int  # indexer query heads (one key head)
    dim: int  # indexer head size
    budget: int  # positions kept from complete blocks
    ratio: int  # compress ratio: positions per block

    @property
    def top_blocks(self) -> int:
        return self.budget // self.ratio


@dataclass(frozen=True)
class Indexer:
    q: QTensor  # [n_heads * dim, hidden]
    k: QTensor  # [dim, hidden]
    q_norm: np.ndarray  # [dim]
    k_norm: np.ndarray  # [dim]

    @classmethod
    def load(cls, ws: WeightStore, p: str, s: QSAShape, hidden: int) -> Indexer:
        return cls(q=ws.tensor(f"{p}.indexer.q_proj.weight", (s.n_heads * s.dim, hidden)),
                   k=ws.tensor(f"{p}.indexer.k_proj.weight", (s.dim, hidden)),
                   q_norm=ws.vector(f"{p}.indexer.q_norm.weight", s.dim),
                   k_norm=ws.vector(f"{p}.indexer.k_norm.weight", s.dim))


def select_positions(dev: Device, x: np.ndarray, w: Indexer, s: QSAShape, cache: IndexedKVCache,
                     positions: np.ndarray, rope_theta: float, rope_dim: int, eps: float) -> np.ndarray:
    """Which cache rows each of the n queries (at ``positions``, consecutive) may attend: bool [n, end],
    end = positions[-1] + 1. Stores the queries' raw index keys and any newly complete blocks in ``cache``."""
    n = x.shape[0]
    start, end = int(positions[0]), int(positions[-1]) + 1
    q = linear(dev, x, w.q).reshape(n, s.n_heads, s.dim)
    q = rope(rmsnorm(q, w.q_norm, eps), positions, rope_theta, rope_dim)
    cache.append_index(linear(dev, x, w.k), start)
    _close_blocks(cache, w, s, end, rope_theta, rope_dim, eps)

    n_blocks = (positions + 1) // s.ratio  # complete blocks each query sees
    allowed = np.zeros((n, end), dtype=bool)
    cols = np.arange(end)
    # Its own partial block: positions n_blocks * r .. t.
    allowed |= (cols >= (n_blocks * s.ratio)[:, None]) & (cols <= positions[:, None])
    total = int(n_blocks.max())
    if total:
        keys = cache.block_k[:total]
        scores = np.maximum(np.einsum("nhd,bd->nhb", q, keys), 0).sum(axis=1) / np.float32(np.sqrt(s.dim))
        scores[np.arange(total)[None, :] >= n_blocks[:, None]] = -np.inf  # blocks not yet complete
        keep = min(s.top_blocks, total)
        best = np.argsort(-scores, axis=1, kind="stable")[:, :keep]
        picked = np.zeros((n, total), dtype=bool)
        valid = np.arange(keep)[None, :] < np.minimum(n_blocks, keep)[:, None]
        np.put_along_axis(picked, best, valid, axis=1)  # invalid picks are -inf blocks: write False there
        allowed[:, : total * s.ratio] |= np.repeat(picked, s.ratio, axis=1)
    return allowed


def _close_blocks(cache: IndexedKVCache, w: Indexer, s: QSAShape, end: int, rope_theta: float, rope_dim: int,
                  eps: float) -> None:
    """Compress the blocks completed by positions up to ``end``: mean raw key, norm, RoPE at the block start."""
    first, last = cache.n_blocks, end // s.ratio
    if last <= first:
        return
    raw = cache.index_k[first * s.ratio: last * s.ratio].reshape(last - first, s.ratio, s.dim)
    pooled = raw.mean(axis=1, dtype=np.float32)[:, None, :]
    starts = np.arange(first, last, dtype=np.int64) * s.ratio
    keys = rope(rmsnorm(pooled, w.k_norm, eps), starts, rope_theta, rope_dim)
    cache.add_blocks(keys[:, 0])
