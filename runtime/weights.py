"""Weights as they lie in the memory-mapped GGUF file.

A ``QTensor`` is a tensor's ggml type, shape and its raw bytes viewed as rows (no copy). Matrices are
[rows, row_bytes]; a 3-D routed-expert tensor is [n_expert, rows, row_bytes] and ``expert(e)`` hands out
expert e as a 2-D QTensor (a contiguous byte range of the file, again no copy). Small tensors (norm
weights, gates' biases, convolution kernels) are decoded to float32 once, at load, through ``WeightStore.vector``
and ``WeightStore.decoded``.

Two exceptions to "no copy", both made at load (load_pages) into anonymous memory on transparent huge pages
(host_memory.huge_page_array), the file's pages they came from read once and left to the page cache:
- IQ2_XS matrices are repacked into IQ2_XS_PLANES (kernels/quant_planes.py), whose dots run 1.5-1.75x as fast on
  CPUs with AVX-512 VBMI, at 1.43x the bytes. ``repack`` decides: "auto" where the CPU has the instructions and the
  model, so grown, takes at most REPACK_RAM_SHARE of the machine's memory; "always" where the CPU has them; "never".
- every other matrix of at least a huge page is copied as it is (``huge_pages``: "auto" where the system can be
  asked for huge pages, the weights are faulted in at load and the model takes at most REPACK_RAM_SHARE of the
  memory; "always"; "never"). A file's own mapping holds 4 KiB pages unless its page cache happens to hold
  large folios mapped whole, and a token streams hundreds of megabytes through the TLB: decoded tokens of the
  synthetic 80B-shaped files, copied against mapped in one process (bench/bench_huge_pages.py, 30 alternating
  rounds), IQ2_XS 1.023-1.055x, Q4_K 1.047-1.057x.
Row tables (ROW_TABLES) stay mapped: a token reads a few of their rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from strata_async.io import GGUFFile, TensorInfo, prefault, release
from strata_async.io.ggml_types import type_name
from strata_async.kernels import quant, quant_planes
from strata_async.kernels.quant_dispatch import dequant_rows_serial
from strata_async.kernels.quant_iq import IQ2_XS
from strata_async.kernels.quant_planes import IQ2_XS_PLANES

from .host_memory import HUGE_PAGE, huge_page_array, huge_pages_advisable
from .placement import MTP_LAYER, decoder_layers, tensor_part

REPACK_MODES = ("auto", "always", "never")
HUGE_PAGE_MODES = ("auto", "always", "never")
_COPY_BYTES = 64 << 20  # file bytes per slice of a copy made at load (one progress report each)
# "auto" repacks while the model, its IQ2_XS tensors grown by IQ2_XS_GROWTH, takes at most this share of the RAM
REPACK_RAM_SHARE = 0.8
_IQ2_XS_BLOCK_BYTES = quant.block_size(IQ2_XS)[1]
IQ2_XS_GROWTH = quant_planes.PLANES_BYTES / _IQ2_XS_BLOCK_BYTES  # bytes of planes per byte of IQ2_XS (106 / 74)
# Tables read a row at a time stay as they lie under any repack mode: a token's rows are a few look-ups, where
# planes would hold 1.43x the bytes for nothing (a head tied to the token embeddings reads them as they lie too).
ROW_TABLES = frozenset({"token_embd.weight", "per_layer_token_embd.weight"})


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
        rows = np.asarray(rows, np.int64)
        table = self.data.reshape(-1, self.data.shape[-1])
        if rows.shape == (1,) and 0 <= rows[0] < table.shape[0]:
            # A decoded token's row straight into the kernel: dequantize's gather, checks and dispatch had cost
            # ~60 us a token with the caches cold (the rows' bytes are the type's by construction).
            out = np.empty((1, self.row_len), np.float32)
            dequant_rows_serial(self.ggml_type, table[rows[0]:rows[0] + 1], out)
            return out
        return quant.dequantize(table[rows], self.ggml_type, (len(rows), self.row_len))

    def dequantize(self) -> np.ndarray:
        """The whole tensor as float32 (small tensors and tests only)."""
        return quant.dequantize(self.data, self.ggml_type, self.shape)


def physical_memory() -> int:
    """This machine's RAM in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def repacked_bytes(gguf: GGUFFile) -> int:
    """The file's IQ2_XS bytes that a repacking WeightStore holds as planes: every IQ2_XS tensor but ROW_TABLES and
    the multi-token-prediction blocks' (which no model here loads)."""
    n_layers = decoder_layers(gguf)
    return sum(int(t.data.nbytes) for name, t in gguf.tensors.items()
               if t.ggml_type == IQ2_XS and name not in ROW_TABLES and tensor_part(name, n_layers) != MTP_LAYER)


def held_bytes(gguf: GGUFFile, repack: bool) -> int:
    """Bytes of the model's tensors as the CPU engine holds them: as they lie in the file, the repacked ones as
    planes where `repack`."""
    total = sum(int(t.data.nbytes) for t in gguf.tensors.values())
    if not repack:
        return total
    return total + repacked_bytes(gguf) // _IQ2_XS_BLOCK_BYTES * (quant_planes.PLANES_BYTES - _IQ2_XS_BLOCK_BYTES)


def repacks_iq2_xs(gguf: GGUFFile, mode: str, ram: int | None = None) -> bool:
    """Whether IQ2_XS matrices become IQ2_XS_PLANES at load under repack mode `mode` (REPACK_MODES), given the
    machine's RAM (default: physical_memory())."""
    if mode not in REPACK_MODES:
        raise ValueError(f"repack must be one of {', '.join(REPACK_MODES)}, got {mode!r}")
    if mode == "never":
        return False
    if not quant_planes.AVAILABLE:
        if mode == "always":
            raise ValueError("repack='always': this CPU lacks AVX-512 VBMI, which the repacked IQ2_XS dots need; "
                             "use 'auto' or 'never'")
        return False
    if mode == "always":
        return True
    return repacked_bytes(gguf) > 0 and held_bytes(gguf, True) <= REPACK_RAM_SHARE * (
        physical_memory() if ram is None else ram)


def copies_to_huge_pages(gguf: GGUFFile, mode: str, repack: bool, prefault: bool = True,
                         ram: int | None = None) -> bool:
    """Whether the matrices that are not repacked are copied at load onto huge pages under mode `mode`
    (HUGE_PAGE_MODES), given whether IQ2_XS is repacked, whether the weights are faulted in at load (a copy reads
    them all; lazily mapped weights stay mapped) and the machine's RAM (default: physical_memory())."""
    if mode not in HUGE_PAGE_MODES:
        raise ValueError(f"huge_pages must be one of {', '.join(HUGE_PAGE_MODES)}, got {mode!r}")
    if mode == "never":
        return False
    if mode == "always":
        if not prefault:
            raise ValueError("huge_pages='always' copies every weight at load, which lazily mapped weights "
                             "(prefault=False, --lazy-weights) do not; use 'auto' or 'never'")
        return True
    return prefault and huge_pages_advisable() and held_bytes(gguf, repack) <= REPACK_RAM_SHARE * (
        physical_memory() if ram is None else ram)


class WeightStore:
    """Hands out a GGUF file's tensors, checked against the shapes the model expects."""

    def __init__(self, gguf: GGUFFile, repack: str = "auto", huge_pages: str = "never", prefault: bool = True):
        self.gguf = gguf
        self._supported = set(quant.supported_types())
        self.handed_out: list[str] = []  # names of the tensors the model computes from, in order
        self.repack = repacks_iq2_xs(gguf, repack)
        self.huge_pages = copies_to_huge_pages(gguf, huge_pages, self.repack, prefault)
        # tensors whose bytes load_pages fills: (file tensor, its planes or copy, whether repacked)
        self._pending: list[tuple[TensorInfo, np.ndarray, bool]] = []
        self._held: dict[str, QTensor] = {}  # the store's own copies by name (a tied head asks twice)

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def tensor(self, name: str, shape: Sequence[int], copy: bool | None = None) -> QTensor:
        """The tensor ``name`` as rows of ggml blocks; ``shape`` in numpy order (last = row length).

        A 2-D expected shape also accepts a stored [1, n] / [n] vector of the same size, as converters differ
        in how they write one-row matrices. Where `copy` (default: unless it is one of ROW_TABLES, read a row at
        a time), an IQ2_XS tensor comes as IQ2_XS_PLANES where the store repacks, and a tensor of at least a huge
        page as a copy on huge pages where the store makes them; their bytes are filled by load_pages, which must
        run before the model computes.
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
        if copy is None:
            copy = name not in ROW_TABLES
        repacked = copy and self.repack and info.ggml_type == IQ2_XS
        if not (repacked or copy and self.huge_pages and data.nbytes >= HUGE_PAGE):
            return QTensor(name, int(info.ggml_type), shape, data)
        if name not in self._held:  # asked for again (a tied head): the same copy
            held = huge_page_array((*shape[:-1], info.row_bytes // _IQ2_XS_BLOCK_BYTES * quant_planes.PLANES_BYTES)
                                   if repacked else data.shape)
            self._held[name] = QTensor(name, IQ2_XS_PLANES if repacked else int(info.ggml_type), shape, held)
            self._pending.append((info, held, repacked))
        return self._held[name]

    def decoded(self, name: str, shape: Sequence[int]) -> np.ndarray:
        """A small tensor (a convolution kernel) decoded once to float32, at load."""
        return self.tensor(name, shape, copy=False).dequantize()

    def vector(self, name: str, length: int) -> np.ndarray:
        """A 1-D tensor (norm weight, bias, per-head constant) decoded once to float32."""
        return self.decoded(name, (1, length)).reshape(length)

    def load_pages(self, fault_in: bool, progress: Callable[[int, int], None] | None = None) -> None:
        """Fill the repacked tensors' planes and the huge-page copies from the file, then (fault_in) map every other
        page the model computes from into memory (io.prefault); progress(done, total bytes) over both."""
        faults = []
        if fault_in:
            faults = [self.gguf.tensors[n] for n in dict.fromkeys(self.handed_out) if n not in self._held]
        total = sum(info.data.nbytes for info, _, _ in self._pending) + sum(t.data.nbytes for t in faults)
        done = 0
        for info, dst, repacked in self._pending:
            src = np.asarray(info.data).reshape(-1, info.row_bytes)
            rows = dst.reshape(-1, dst.shape[-1])
            step = max(1, _COPY_BYTES // info.row_bytes)  # a copy in slices, for the progress of the big ones
            for r in range(0, rows.shape[0], step):
                if repacked:
                    quant_planes.repack_iq2_xs(src[r:r + step], rows[r:r + step])
                else:
                    rows[r:r + step] = src[r:r + step]
                done += src[r:r + step].nbytes
                if progress is not None:
                    progress(done, total)
            release(info)  # its file pages are not read again
        self._pending = []
        if faults:
            prefault(faults, None if progress is None else lambda d, _: progress(done + d, total))
