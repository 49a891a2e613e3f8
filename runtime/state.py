"""Per-sequence state: what a model remembers between forward calls.

Attention layers keep a KV cache, DeltaNet layers a convolution history and a recurrent state. A
``SequenceState`` holds one entry per decoder layer plus the position of the next token; ``copy()`` gives
an independent snapshot (for prompt caching or to branch a sequence), ``compact()`` one without spare
capacity. Every layer state implements ``copy()``, ``compact()`` and ``nbytes``.
"""

from __future__ import annotations

import copy
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
        self.make_room(k.shape[0])
        self.k[self.length:end] = k
        self.v[self.length:end] = v
        self.length = end

    def make_room(self, n: int) -> None:
        """Grow the arrays so that rows [length, length + n) exist (for a caller that writes them itself and then
        counts them into length)."""
        end = self.length + n
        if end > self.max_context:
            raise ValueError(f"KV cache holds at most {self.max_context} positions; {end} requested")
        self.k = _grown(self.k, end, self.length, self.max_context)
        self.v = _grown(self.v, end, self.length, self.max_context)

    def copy(self) -> KVCache:
        other = copy.copy(self)
        other.k, other.v = self.k.copy(), self.v.copy()
        return other

    def compact(self) -> KVCache:
        """An independent copy holding only the filled rows (a later append regrows the capacity)."""
        other = copy.copy(self)
        other.k, other.v = self.k[: self.length].copy(), self.v[: self.length].copy()
        return other

    @property
    def nbytes(self) -> int:
        """Bytes of the filled rows."""
        return self.k[: self.length].nbytes + self.v[: self.length].nbytes


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

    compact = copy

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


@dataclass
class IndexedKVCache(KVCache):
    """A KV cache plus what a QSA indexer keeps: each position's raw index key, and the compressed key of
    every complete block of ``compress_ratio`` positions (computed once, when the block fills)."""

    index_dim: int = 0
    index_k: np.ndarray = field(init=False)  # [capacity, index_dim]; rows [0, length) filled
    block_k: np.ndarray = field(init=False)  # [block capacity, index_dim]; rows [0, n_blocks) filled
    n_blocks: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.index_k = np.zeros((self.k.shape[0], self.index_dim), np.float32)
        self.block_k = np.zeros((0, self.index_dim), np.float32)

    def append_index(self, keys: np.ndarray, start: int) -> None:
        """Store the raw index keys [n, index_dim] of positions start .. start + n - 1."""
        end = start + keys.shape[0]
        self.index_k = _grown(self.index_k, end, start)
        self.index_k[start:end] = keys

    def add_blocks(self, keys: np.ndarray) -> None:
        """Append the compressed keys [m, index_dim] of the next m complete blocks."""
        end = self.n_blocks + keys.shape[0]
        self.block_k = _grown(self.block_k, end, self.n_blocks)
        self.block_k[self.n_blocks:end] = keys
        self.n_blocks = end

    def copy(self) -> IndexedKVCache:
        other = super().copy()
        other.index_k, other.block_k = self.index_k.copy(), self.block_k.copy()
        return other

    def compact(self) -> IndexedKVCache:
        other = super().compact()
        other.index_k = self.index_k[: self.length].copy()
        other.block_k = self.block_k[: self.n_blocks].copy()
        return other

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.index_k[: self.length].nbytes + self.block_k[: self.n_blocks].nbytes


def _grown(a: np.ndarray, rows: int, keep: int, limit: int | None = None) -> np.ndarray:
    """``a`` with at least ``rows`` rows (doubling, at most ``limit``), its first ``keep`` rows kept; ``a`` itself
    if big enough."""
    if a.shape[0] >= rows:
        return a
    size = max(rows, 2 * a.shape[0])
    grown = np.zeros((size if limit is None else min(size, limit), *a.shape[1:]), a.dtype)
    grown[:keep] = a[:keep]
    return grown


@dataclass
class PLEState:
    """The n-gram PLE module's memory: the previous ngram_size - 1 token ids (the end-of-sequence id before
    the first token) and the inputs of the dilated convolution's last (kernel - 1) * dilation steps."""

    context: np.ndarray  # int64 [ngram_size - 1]
    conv: np.ndarray  # float32 [(kernel - 1) * dilation, channels]

    def copy(self) -> PLEState:
        return PLEState(self.context.copy(), self.conv.copy())

    compact = copy

    @property
    def nbytes(self) -> int:
        return self.context.nbytes + self.conv.nbytes


@dataclass
class PLELayerState:
    """A layer with a PLE module: the PLE state beside the state of the layer's token mixer."""

    mixer: DeltaNetState
    ple: PLEState

    def copy(self) -> PLELayerState:
        return PLELayerState(self.mixer.copy(), self.ple.copy())

    def compact(self) -> PLELayerState:
        return PLELayerState(self.mixer.compact(), self.ple.compact())

    @property
    def nbytes(self) -> int:
        return self.mixer.nbytes + self.ple.nbytes


@dataclass
class SequenceState:
    layers: list[KVCache | DeltaNetState | PLELayerState]  # one per decoder layer
    max_context: int
    position: int = 0  # tokens consumed so far = position of the next token

    def copy(self) -> SequenceState:
        return SequenceState([layer.copy() for layer in self.layers], self.max_context, self.position)

    def compact(self) -> SequenceState:
        """An independent copy whose growable buffers hold only what is filled (for snapshots)."""
        return SequenceState([layer.compact() for layer in self.layers], self.max_context, self.position)

    @property
    def nbytes(self) -> int:
        """Bytes a compact copy holds."""
        return sum(layer.nbytes for layer in self.layers)
