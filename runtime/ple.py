"""The n-gram Per-Layer Embedding (PLE) module of qwen4exp, with its table left on disk.

Row ids. For every token t and n-gram order k = 2 .. N (N = ngram_size), the ids of tokens t, t-1, .., t-k+1
are mixed as  tok_t * m_0  XOR  tok_{t-1} * m_1  XOR ...  (64-bit, with the file's multipliers m); a
predecessor is replaced by the end-of-sequence id when it lies before the start of the sequence or an
end-of-sequence token stands between it and t (a document boundary). Each of the heads_per_ngram heads of
order k takes that value modulo its own prime vocabulary size plus its offset: one row of the shared table.

Module, on the hidden streams h [n, hc * d]:

    e     = concat(table rows of the token's heads)                        [n, heads * row_dim]
    key   = rmsnorm(W_key e) per stream;  value = W_value e;  query = rmsnorm(h) per stream
    gate  = signed sqrt of (key . query) / sqrt(d), per stream
    g     = sigmoid(gate) * value, per stream                               [n, hc * d]
    out   = g + silu(dilated causal depthwise conv(rmsnorm(g) per stream))  kernel K, dilation N
    h     = h + out                                                         (before the layer's mixer)

The table (tens of GB for the real model) is read row by row through a ``PLERowSource``: O_DIRECT reads by
default, so it never fills RAM or the page cache. The rows a prompt chunk or a decode step needs are
requested when the step starts, and waited for only when the PLE layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata_async.io import TensorInfo
from strata_async.io.ggml_types import type_name
from strata_async.io.ple_rows import MODES, PLERowSource, PLEStats
from strata_async.kernels import quant

from .device import Device
from .layers import group_rmsnorm, linear, sigmoid, silu
from .state import PLEState
from .weights import QTensor, WeightError, WeightStore

TABLE_TENSOR = "per_layer_token_embd.weight"


@dataclass(frozen=True)
class NGramHash:
    ngram_size: int
    heads_per_ngram: int
    eos_id: int
    multipliers: np.ndarray  # int64 [ngram_size]
    head_offsets: np.ndarray  # int64 [heads]
    head_sizes: np.ndarray  # int64 [heads]: a prime per head

    @property
    def n_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def rows_needed(self) -> int:
        """Rows the table must have: the end of the last head's range."""
        return int((self.head_offsets + self.head_sizes).max())

    def new_context(self) -> np.ndarray:
        return np.full(self.ngram_size - 1, self.eos_id, np.int64)

    def row_ids(self, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Table rows int64 [n, heads] of the tokens, which follow the ``context`` ids (the previous
        ngram_size - 1 tokens, end-of-sequence ids before the first)."""
        c = self.ngram_size - 1
        hist = np.concatenate([context, tokens]).astype(np.int64)
        n = len(tokens)
        eos_before = np.concatenate([[0], np.cumsum(hist == self.eos_id)])  # EOS count in hist[:p]
        p = np.arange(c, c + n)
        mixed = hist[p] * self.multipliers[0]
        ids = np.empty((n, self.n_heads), np.int64)
        for shift in range(1, self.ngram_size):
            boundary = eos_before[p] - eos_before[p - shift] > 0  # an EOS among the `shift` predecessors
            prev = np.where(boundary, self.eos_id, hist[p - shift])
            mixed = mixed ^ (prev * self.multipliers[shift])
            heads = slice((shift - 1) * self.heads_per_ngram, shift * self.heads_per_ngram)
            ids[:, heads] = mixed[:, None] % self.head_sizes[heads] + self.head_offsets[heads]
        return ids

    def advance(self, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The context after the tokens."""
        return np.concatenate([context, np.asarray(tokens, np.int64)])[-(self.ngram_size - 1):]


class NGramTable:
    """The PLE table's rows, decoded to float32, from the file through a ``PLERowSource``."""

    def __init__(self, info: TensorInfo, row_dim: int, rows_needed: int, mode: str, cache_rows: int):
        if mode not in MODES:
            raise ValueError(f"PLE table I/O mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.check(info, row_dim, rows_needed)
        self.info, self.row_dim, self.mode = info, row_dim, mode
        self.source = PLERowSource(info.file_path, info.file_offset, info.row_bytes, info.n_rows, mode=mode,
                                   cache_rows=cache_rows)

    @staticmethod
    def check(info: TensorInfo, row_dim: int, rows_needed: int) -> None:
        """Raise a clear error if the stored table cannot be the one the metadata describes."""
        if info.row_len != row_dim:
            raise WeightError(f"{info.file_path}: PLE table '{info.name}' has rows of {info.row_len} values, the "
                              f"model's metadata (embedding_length_per_layer_input) says {row_dim}")
        if info.n_rows < rows_needed:
            raise WeightError(f"{info.file_path}: PLE table '{info.name}' has {info.n_rows} rows, but the n-gram "
                              f"heads address rows up to {rows_needed - 1}; the table does not match its header")
        if info.ggml_type not in quant.supported_types():
            raise WeightError(f"{info.file_path}: PLE table is stored as {type_name(info.ggml_type)}, which has no "
                              "kernel")

    @property
    def nbytes(self) -> int:
        return self.info.row_bytes * self.info.n_rows

    @property
    def stats(self) -> PLEStats:
        return self.source.stats

    def prefetch(self, row_ids: np.ndarray) -> None:
        self.source.prefetch(row_ids)

    def rows(self, row_ids: np.ndarray) -> np.ndarray:
        """float32 [*row_ids.shape, row_dim]."""
        raw = self.source.rows(row_ids)
        return quant.dequantize(raw, self.info.ggml_type, (raw.shape[0], self.row_dim)).reshape(
            *row_ids.shape, self.row_dim)

    def close(self) -> None:
        self.source.close()


@dataclass(frozen=True)
class PLEWeights:
    key: QTensor  # [hc * d, embed]
    value: QTensor  # [d, embed]
    norm_key: np.ndarray  # [hc * d]
    norm_query: np.ndarray  # [hc * d]
    norm_conv: np.ndarray  # [hc * d]
    conv: np.ndarray  # [hc * d, kernel]

    @classmethod
    def load(cls, ws: WeightStore, p: str, hc: int, d: int, embed: int, kernel: int) -> PLEWeights:
        c = hc * d
        return cls(key=ws.tensor(f"{p}.ple_key.weight", (c, embed)),
                   value=ws.tensor(f"{p}.ple_value.weight", (d, embed)),
                   norm_key=ws.vector(f"{p}.ple_norm_key.weight", c),
                   norm_query=ws.vector(f"{p}.ple_norm_query.weight", c),
                   norm_conv=ws.vector(f"{p}.ple_norm_conv.weight", c),
                   conv=ws.decoded(f"{p}.ple_conv1d.weight", (c, kernel)))


def new_ple_state(ngram: NGramHash, w: PLEWeights) -> PLEState:
    kernel = w.conv.shape[1]
    return PLEState(ngram.new_context(), np.zeros(((kernel - 1) * ngram.ngram_size, w.conv.shape[0]), np.float32))


def ple_module(dev: Device, h: np.ndarray, emb: np.ndarray, w: PLEWeights, state: PLEState, hc: int,
               dilation: int, eps: float) -> np.ndarray:
    """The PLE output [n, hc * d] for hidden streams h [n, hc * d] and gathered rows emb [n, embed];
    advances the convolution history in ``state`` (the token context is advanced by the caller)."""
    n = h.shape[0]
    d = h.shape[1] // hc
    key = group_rmsnorm(linear(dev, emb, w.key), w.norm_key, hc, eps).reshape(n, hc, d)
    value = linear(dev, emb, w.value)
    query = group_rmsnorm(h, w.norm_query, hc, eps).reshape(n, hc, d)
    gate = np.einsum("nsd,nsd->ns", key, query) / np.float32(np.sqrt(d))
    gate = np.sign(gate) * np.sqrt(np.maximum(np.abs(gate), np.float32(1e-6)))
    gated = (sigmoid(gate)[:, :, None] * value[:, None, :]).reshape(n, hc * d)
    normed = group_rmsnorm(gated, w.norm_conv, hc, eps)
    x = np.concatenate([state.conv, normed])  # [history + n, channels]
    hist = state.conv.shape[0]
    conv = np.zeros_like(normed)
    for j in range(w.conv.shape[1]):  # tap j reads the input (kernel - 1 - j) * dilation steps back
        conv += x[j * dilation: j * dilation + n] * w.conv[:, j]
    state.conv = np.ascontiguousarray(x[-hist:]) if hist else state.conv
    return gated + silu(conv)
