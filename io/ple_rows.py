"""Rows of a Per-Layer-Embedding table that stays on disk, fetched a step ahead, with a small row cache.

The n-gram PLE table of qwen4exp is tens of GB; each token needs only the few rows its last token ids hash
to. `PLERowSource` serves those rows from one of three backing stores:

- "direct": O_DIRECT reads through a `DirectReader`, so the table never enters RAM or the page cache;
- "mmap":   slices of a read-only mapping of the file (the page cache holds what was touched);
- "ram":    the whole table read into memory once at construction.

The engine calls `prefetch(next_ids)` as soon as the next token's rows are known and `rows(ids)` when it
needs them; rows read ahead land in a bounded LRU cache, so `rows` then only waits for reads still in
flight. One `rows` call is one fetch (the engine makes one per token step), and its duration is the wait
that step saw. Use from one thread.
"""

from __future__ import annotations

import mmap
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from .direct_reader import DirectReader, ReadError

MODES = ("direct", "mmap", "ram")


@dataclass
class PLEStats:
    """What a `PLERowSource` did since construction (or the last `reset_stats`)."""

    rows_requested: int = 0  # row ids asked of `rows`, duplicates included
    cache_hits: int = 0  # distinct rows of a `rows` call served from the cache
    rows_read: int = 0  # rows fetched from the backing store (prefetched or read on demand)
    bytes_read: int = 0  # rows_read * row_bytes
    fetches: int = 0  # `rows` calls
    wait_total_s: float = 0.0  # time spent inside `rows`, all calls
    recent_waits_s: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))  # per call, latest

    @property
    def wait_mean_s(self) -> float:
        return self.wait_total_s / self.fetches if self.fetches else 0.0

    @property
    def wait_p99_s(self) -> float:
        """99th percentile of the per-call waits over the latest 100 000 calls."""
        waits = tuple(self.recent_waits_s)  # one C-level copy: safe while the compute thread appends
        return float(np.percentile(waits, 99)) if waits else 0.0


class PLERowSource:
    """Rows [n_rows, row_bytes] of a table stored contiguously at byte `data_offset` of `path`."""

    def __init__(self, path: str | os.PathLike[str], data_offset: int, row_bytes: int, n_rows: int, *,
                 mode: str = "direct", cache_rows: int = 4096, workers: int = 4):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if row_bytes <= 0 or n_rows <= 0:
            raise ValueError(f"row_bytes and n_rows must be positive, got row_bytes={row_bytes}, n_rows={n_rows}")
        if data_offset < 0:
            raise ValueError(f"data_offset must be >= 0, got {data_offset}")
        if cache_rows < 1:
            raise ValueError(f"cache_rows must be at least 1 (prefetched rows wait there), got {cache_rows}")
        self.path = os.fspath(path)
        self.data_offset, self.row_bytes, self.n_rows, self.mode = data_offset, row_bytes, n_rows, mode
        size = os.stat(self.path).st_size
        end = data_offset + row_bytes * n_rows
        if end > size:
            raise ValueError(f"PLE table of {n_rows} rows x {row_bytes} bytes at offset {data_offset} ends at byte "
                             f"{end}, but {self.path} has only {size} bytes: the file is truncated or its header "
                             "describes a different table; re-download or re-convert it")
        self.stats = PLEStats()
        # The cache: row id -> slot in a fixed slab, least recently used first.
        self._slab = np.empty((cache_rows, row_bytes), dtype=np.uint8)
        self._slots: OrderedDict[int, int] = OrderedDict()
        # Direct mode: row id -> (ticket, index in the ticket) for reads submitted and not yet absorbed.
        self._in_flight: dict[int, tuple[int, int]] = {}
        self._reader: DirectReader | None = None
        self._map: mmap.mmap | None = None
        self._table: np.ndarray | None = None  # mmap mode: view of the mapping; ram mode: the copy
        if mode == "direct":
            self._reader = DirectReader(self.path, workers=workers)
        elif mode == "mmap":
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            # Rows are read at random: without this each page fault reads ahead hundreds of KB around the row,
            # and a few thousand tokens pull the whole table into the page cache.
            self._map.madvise(mmap.MADV_RANDOM)
            self._table = np.frombuffer(self._map, np.uint8, row_bytes * n_rows, data_offset).reshape(n_rows, -1)
        else:
            self._table = np.empty((n_rows, row_bytes), dtype=np.uint8)
            with open(self.path, "rb") as f:
                f.seek(data_offset)
                if f.readinto(memoryview(self._table).cast("B")) != self._table.nbytes:
                    raise ValueError(f"{self.path} ended before the PLE table's {self._table.nbytes} bytes were read")

    def _check_ids(self, row_ids: np.ndarray | list[int]) -> np.ndarray:
        ids = np.asarray(row_ids, dtype=np.int64).ravel()
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_rows):
            bad = ids[(ids < 0) | (ids >= self.n_rows)][0]
            raise IndexError(f"PLE row {bad} is outside the table's {self.n_rows} rows")
        return ids

    def prefetch(self, row_ids: np.ndarray | list[int]) -> None:
        """Start reading the rows neither cached nor already on their way; returns without waiting."""
        ids = self._check_ids(row_ids)
        if self._reader is not None:
            self._absorb_finished()
            todo = [r for r in dict.fromkeys(ids.tolist()) if r not in self._slots and r not in self._in_flight]
            if todo:
                ticket = self._reader.submit([(self.data_offset + r * self.row_bytes, self.row_bytes) for r in todo])
                for i, r in enumerate(todo):
                    self._in_flight[r] = (ticket, i)
                self._count_read(len(todo))
        elif self._map is not None:
            # Ask the kernel to start reading the pages ahead (asynchronous readahead).
            for r in np.unique(ids).tolist():
                if r not in self._slots:
                    start = self.data_offset + r * self.row_bytes
                    page = start // mmap.PAGESIZE * mmap.PAGESIZE
                    self._map.madvise(mmap.MADV_WILLNEED, page, start + self.row_bytes - page)

    def rows(self, row_ids: np.ndarray | list[int]) -> np.ndarray:
        """The rows, uint8 [len(row_ids), row_bytes]: from the cache, from reads in flight (waiting for them),
        or read now."""
        t0 = time.perf_counter()
        ids = self._check_ids(row_ids)
        unique, inverse = np.unique(ids, return_inverse=True)
        got = np.empty((unique.size, self.row_bytes), dtype=np.uint8)
        missing: list[tuple[int, int]] = []  # (position in unique, row id)
        waiting: dict[int, list[tuple[int, int, int]]] = {}  # ticket -> (position, row id, index in ticket)
        for pos, r in enumerate(unique.tolist()):
            slot = self._slots.get(r)
            if slot is not None:
                self._slots.move_to_end(r)
                got[pos] = self._slab[slot]
                self.stats.cache_hits += 1
            elif r in self._in_flight:
                ticket, index = self._in_flight[r]
                waiting.setdefault(ticket, []).append((pos, r, index))
            else:
                missing.append((pos, r))
        for ticket, wanted in waiting.items():
            arrays = self._take(ticket, self._harvest(ticket))
            for pos, _, index in wanted:
                got[pos] = arrays[index]
        if missing:
            self._read_now(missing, got)
        self.stats.rows_requested += ids.size
        self.stats.fetches += 1
        wait = time.perf_counter() - t0
        self.stats.wait_total_s += wait
        self.stats.recent_waits_s.append(wait)
        return got[inverse]

    def _read_now(self, missing: list[tuple[int, int]], got: np.ndarray) -> None:
        positions = [p for p, _ in missing]
        rows = [r for _, r in missing]
        if self._reader is not None:
            ticket = self._reader.submit([(self.data_offset + r * self.row_bytes, self.row_bytes) for r in rows])
            got[positions] = np.stack(self._harvest(ticket))
        else:
            got[positions] = self._table[rows]
        self._count_read(len(rows))
        for p, r in missing:
            self._cache(r, got[p])

    def _take(self, ticket: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Move a finished prefetch ticket's rows into the cache; return its arrays."""
        for r, (t, index) in list(self._in_flight.items()):
            if t == ticket:
                del self._in_flight[r]
                self._cache(r, arrays[index])
        return arrays

    def _harvest(self, ticket: int) -> list[np.ndarray]:
        try:
            return self._reader.harvest(ticket)
        except ReadError as e:
            self._forget(e.ticket)
            raise

    def _absorb_finished(self) -> None:
        """Cache the rows of prefetches that have finished, so unclaimed ones do not pile up in flight."""
        try:
            for ticket, arrays in self._reader.completions(timeout=0):
                self._take(ticket, arrays)
        except ReadError as e:
            self._forget(e.ticket)
            raise

    def _forget(self, ticket: int | None) -> None:
        """Drop the in-flight entries of a ticket whose read failed, so a later call reads those rows anew."""
        for r in [r for r, (t, _) in self._in_flight.items() if t == ticket]:
            del self._in_flight[r]

    def _cache(self, r: int, row: np.ndarray) -> None:
        if r in self._slots:
            self._slots.move_to_end(r)
            return
        if len(self._slots) < len(self._slab):
            slot = len(self._slots)
        else:
            _, slot = self._slots.popitem(last=False)
        self._slab[slot] = row
        self._slots[r] = slot

    def _count_read(self, n: int) -> None:
        self.stats.rows_read += n
        self.stats.bytes_read += n * self.row_bytes

    def reset_stats(self) -> None:
        self.stats = PLEStats()

    def close(self) -> None:
        """Stop the reader threads and release the mapping or the in-memory copy."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self._table = None
        if self._map is not None:
            self._map.close()
            self._map = None

    def __enter__(self) -> PLERowSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
