"""Weights as they lie in the memory-mapped GGUF file.

A ``QTensor`` is a tensor's ggml type, shape and its raw bytes viewed as rows (no copy). Matrices are
[rows, row_bytes]; a 3-D routed-expert tensor is [n_expert, rows, row_bytes] and ``expert(e)`` hands out
expert e as a 2-D QTensor (a contiguous byte range of the file, again no copy). Small tensors (norm
weights, gates' biases) are decoded to float32 once, at load, through ``WeightStore.vector``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from strata_async.io import GGUFFile
from strata_async.io.ggml_types import type_name
from strata_async.kernels import quant


class WeightError(ValueError):
    """A tensor the model needs is missing, has the wrong shape, or has a type no kernel computes."""


@dataclass(frozen=True, eq=False)  # identity equality/hash: usable as a cache key, never compared by value
class QTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order: last = row length (the input dimension of a matrix)
    data: np.ndarray  # uint8, shape (*shape[:-1], row_bytes): rows of ggml blocks, a view of the file

    @property
    def rows(self) -> int:
        return self.shape[-2]

    @property
    def row_len(self) -> int:
        return self.shape[-1]

    @property
    def n_experts(self) -> int:
        return self.shape[0] if len(self.shape) == 3 else 0

    def expert(self, e: int) -> QTensor:
        """Expert ``e`` of a 3-D expert tensor as a 2-D matrix (a view, nothing is copied)."""
        if len(self.shape) != 3:
            raise ValueError(f"tensor '{self.name}' has shape {self.shape}; only 3-D expert tensors hold experts")
        return QTensor(f"{self.name}[{e}]", self.ggml_type, self.shape[1:], self.data[e])

    def take_rows(self, rows: np.ndarray) -> np.ndarray:
        """Decode only the given rows to float32 [len(rows), row_len] (embedding lookup)."""
        picked = self.data.reshape(-1, self.data.shape[-1])[np.asarray(rows, np.int64)]
        return quant.dequantize(picked, self.ggml_type, (len(picked), self.row_len))

    def dequantize(self) -> np.ndarray:
        """The whole tensor as float32 (small tensors and tests only)."""
        return quant.dequantize(self.data, self.ggml_type, self.shape)


class WeightStore:
    """Hands out a GGUF file's tensors, checked against the shapes the model expects."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self._supported = set(quant.supported_types())
        self.handed_out: list[str] = []  # names of the tensors the model computes from, in order

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def tensor(self, name: str, shape: Sequence[int]) -> QTensor:
        """The tensor ``name`` as rows of ggml blocks; ``shape`` in numpy order (last = row length).

        A 2-D expected shape also accepts a stored [1, n] / [n] vector of the same size, as converters differ
        in how they write one-row matrices.
        """
        info = self.gguf.tensors.get(name)
        if info is None:
            raise WeightError(f"{self.gguf.path}: tensor '{name}' is missing; the file is incomplete or was "
                              f"converted for a different model layout")
        shape = tuple(int(s) for s in shape)
        stored = tuple(int(s) for s in info.shape)
        if stored != shape and not (len(shape) == 2 and shape[0] == 1 and stored in ((shape[1],), shape)):
            raise WeightError(f"{self.gguf.path}: tensor '{name}' has shape {list(stored)}, the model's "
                              f"metadata implies {list(shape)}")
        if info.ggml_type not in self._supported:
            raise WeightError(
                f"{self.gguf.path}: tensor '{name}' is stored as {type_name(info.ggml_type)} (ggml type "
                f"{info.ggml_type}), which has no kernel; supported types: "
                + ", ".join(type_name(t) for t in sorted(self._supported)))
        # A plain ndarray view of the mapping: np.memmap's Python-level slicing hooks cost ~2 us per use.
        data = np.asarray(info.data).reshape(*shape[:-1], info.row_bytes)
        self.handed_out.append(name)
        return QTensor(name, int(info.ggml_type), shape, data)

    def vector(self, name: str, length: int) -> np.ndarray:
        """A 1-D tensor (norm weight, bias, per-head constant) decoded once to float32."""
        return self.tensor(name, (1, length)).dequantize().reshape(length)
