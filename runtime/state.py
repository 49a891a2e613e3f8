"""Per-sequence state: what a model remembers between forward calls.

Attention layers keep a KV cache, DeltaNet layers a convolution history and a recurrent state. A
``SequenceState`` holds one entry per decoder layer plus the position of the next token; ``copy()`` gives
an independent snapshot (for prompt caching or to branch a sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# First allocation of a KV cache, in positions; it doubles as the sequence grows (up to max_context).
_KV_INITIAL_CAPACITY = 256


@dataclass
class KVCache:
    n_kv_heads: int
    head_dim: int
    max_context: int
    # Keys/values of positions [0, length) in rows [0, length); rows beyond are spare capacity.
    k: np.ndarray = field(init=False)
    v: np.ndarray = field(init=False)
    length: int = 0

    def __post_init__(self) -> None:
        cap = min(_KV_INITIAL_CAPACITY, self.max_context)
        self.k = np.zeros((cap, self.n_kv_heads, self.head_dim), np.float32)
        self.v = np.zeros_like(self.k)

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Store the keys/values [n, n_kv_heads, head_dim] of the next n positions."""
        end = self.length + k.shape[0]
        if end > self.max_context:
            raise ValueError(f"KV cache holds at most {self.max_context} positions; {end} requested")
        if end > self.k.shape[0]:
            cap = min(self.max_context, max(end, 2 * self.k.shape[0]))
            for name in ("k", "v"):
                grown = np.zeros((cap, self.n_kv_heads, self.head_dim), np.float32)
                grown[: self.length] = getattr(self, name)[: self.length]
                setattr(self, name, grown)
        self.k[self.length:end] = k
        self.v[self.length:end] = v
        self.length = end

    def copy(self) -> KVCache:
        other = KVCache(self.n_kv_heads, self.head_dim, self.max_context)
        other.k, other.v, other.length = self.k.copy(), self.v.copy(), self.length
        return other


@dataclass
class DeltaNetState:
    conv: np.ndarray  # [kernel-1, conv channels]: the last kernel-1 inputs of the causal convolution
    recurrent: np.ndarray  # [value heads, key head dim, value head dim]: the delta rule's state matrix

    @classmethod
    def zeros(cls, conv_kernel: int, conv_channels: int, n_v_heads: int, k_dim: int, v_dim: int) -> DeltaNetState:
        return cls(np.zeros((conv_kernel - 1, conv_channels), np.float32),
                   np.zeros((n_v_heads, k_dim, v_dim), np.float32))

    def copy(self) -> DeltaNetState:
        return DeltaNetState(self.conv.copy(), self.recurrent.copy())


@dataclass
class SequenceState:
    layers: list[KVCache | DeltaNetState]  # one per decoder layer
    max_context: int
    position: int = 0  # tokens consumed so far = position of the next token

    def copy(self) -> SequenceState:
        return SequenceState([layer.copy() for layer in self.layers], self.max_context, self.position)
