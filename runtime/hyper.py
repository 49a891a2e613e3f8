"""Hyper-connections (qwen4exp): hc_count residual streams in place of the one residual stream.

The hidden state is [n, hc * d]: hc streams of width d side by side. Around each block:

    hn     = rmsnorm(h) per stream, times the learned weight (GGUF stores 1 + weight)
    mix    = sigmoid(W_up silu(W_down hn / hc))                    [n, hc * d]
    x      = mean over streams of (mix * hn)                       the block's input [n, d]
    inject = 2 * sigmoid(W_inject hn / hc)                         [n, hc]
    h      = h + inject[:, s] * block(x)    for every stream s     the gated write back

The final mixer is the read alone (no inject): its output goes to the output head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .device import Device
from .layers import group_rmsnorm, linear, sigmoid, silu
from .weights import QTensor, WeightStore


@dataclass(frozen=True)
class HyperConnection:
    norm: np.ndarray  # [hc * d]
    down: QTensor  # [low_rank, hc * d]
    up: QTensor  # [hc * d, low_rank]
    inject: QTensor | None  # [hc, hc * d]; None for the final mixer

    @classmethod
    def load(cls, ws: WeightStore, prefix: str, hc: int, d: int, low_rank: int, inject: bool) -> HyperConnection:
        return cls(norm=ws.vector(f"{prefix}_norm.weight", hc * d),
                   down=ws.tensor(f"{prefix}_down.weight", (low_rank, hc * d)),
                   up=ws.tensor(f"{prefix}_up.weight", (hc * d, low_rank)),
                   inject=ws.tensor(f"{prefix}_inject.weight", (hc, hc * d)) if inject else None)


def hc_read(dev: Device, w: HyperConnection, h: np.ndarray, hc: int, eps: float
            ) -> tuple[np.ndarray, np.ndarray | None]:
    """The block input x [n, d] mixed from the streams of h [n, hc * d], and the injection weights [n, hc]
    (None for the final mixer)."""
    n = h.shape[0]
    d = h.shape[1] // hc
    hn = group_rmsnorm(h, w.norm, hc, eps)
    mix = sigmoid(linear(dev, silu(linear(dev, hn, w.down) / np.float32(hc)), w.up))
    x = (mix * hn).reshape(n, hc, d).mean(axis=1, dtype=np.float32)
    if w.inject is None:
        return x, None
    return x, np.float32(2.0) * sigmoid(linear(dev, hn, w.inject) / np.float32(hc))


def hc_write(h: np.ndarray, y: np.ndarray, inject: np.ndarray) -> np.ndarray:
    """h + inject[:, s] * y for every stream s; h [n, hc * d], y [n, d], inject [n, hc]."""
    return h + (inject[:, :, None] * y[:, None, :]).reshape(h.shape)
