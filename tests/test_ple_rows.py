"""PLERowSource in its three modes against numpy slices of the file's bytes; the cache, prefetch and counters."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from strata_async.io import PLERowSource, ReadError

MODES = ["direct", "mmap", "ram"]


def write_table(path: Path, rng: np.random.Generator, n_rows: int, row_bytes: int) -> tuple[int, np.ndarray]:
    """A file with random bytes around a random table at an unaligned offset; returns (offset, table)."""
    offset = int(rng.integers(1, 5000))
    table = rng.integers(0, 256, size=(n_rows, row_bytes), dtype=np.uint8)
    tail = rng.integers(0, 256, size=int(rng.integers(0, 3000)), dtype=np.uint8)
    path.write_bytes(rng.integers(0, 256, size=offset, dtype=np.uint8).tobytes() + table.tobytes() + tail.tobytes())
    return offset, table


@pytest.fixture
def table_file(tmp_path: Path):
    rng = np.random.default_rng()
    path = tmp_path / "ple.bin"
    row_bytes = int(rng.choice([1440, 37, 4096, 5000]))
    offset, table = write_table(path, rng, int(rng.integers(200, 400)), row_bytes)
    return path, offset, table


@pytest.mark.parametrize("mode", MODES)
def test_rows_match_the_file(mode: str, table_file) -> None:
    path, offset, table = table_file
    n_rows, row_bytes = table.shape
    rng = np.random.default_rng()
    with PLERowSource(path, offset, row_bytes, n_rows, mode=mode, cache_rows=32) as src:
        for step in range(20):
            ids = rng.integers(0, n_rows, size=16)
            ids[3] = ids[7]  # a row asked twice in one call
            if step % 2:
                src.prefetch(ids)
            got = src.rows(ids)
            assert got.dtype == np.uint8 and got.shape == (16, row_bytes)
            np.testing.assert_array_equal(got, table[ids])
        np.testing.assert_array_equal(src.rows([0, n_rows - 1]), table[[0, n_rows - 1]])
        assert src.rows([]).shape == (0, row_bytes)


def test_modes_agree_and_count_alike(table_file) -> None:
    path, offset, table = table_file
    n_rows, row_bytes = table.shape
    calls = [np.random.default_rng().integers(0, n_rows, size=16) for _ in range(30)]
    results, stats = {}, {}
    for mode in MODES:
        with PLERowSource(path, offset, row_bytes, n_rows, mode=mode, cache_rows=40) as src:
            results[mode] = [src.rows(ids) for ids in calls]
            s = src.stats
            stats[mode] = (s.rows_requested, s.rows_read, s.cache_hits, s.bytes_read, s.fetches)
    for mode in MODES[1:]:
        for a, b in zip(results["direct"], results[mode]):
            np.testing.assert_array_equal(a, b)
        assert stats[mode] == stats["direct"]


@pytest.mark.parametrize("mode", MODES)
def test_cache_is_lru_and_counters_move(mode: str, table_file) -> None:
    path, offset, table = table_file
    n_rows, row_bytes = table.shape
    a, b, c = (int(x) for x in np.random.default_rng().choice(n_rows, size=3, replace=False))
    with PLERowSource(path, offset, row_bytes, n_rows, mode=mode, cache_rows=2) as src:
        src.rows([a, b])
        s = src.stats
        assert (s.rows_requested, s.rows_read, s.cache_hits, s.bytes_read) == (2, 2, 0, 2 * row_bytes)
        src.rows([a, b, a])  # both cached; `a` asked twice is one hit
        assert (s.rows_requested, s.rows_read, s.cache_hits) == (5, 2, 2)
        src.rows([a])  # a is now the most recently used, b the least
        src.rows([c])  # evicts b
        assert (s.rows_read, s.cache_hits) == (3, 3)
        np.testing.assert_array_equal(src.rows([a]), table[[a]])
        assert (s.rows_read, s.cache_hits) == (3, 4)
        np.testing.assert_array_equal(src.rows([b]), table[[b]])
        assert (s.rows_read, s.cache_hits) == (4, 4)
        assert s.fetches == 6 and s.wait_total_s > 0
        waits = list(s.recent_waits_s)
        assert len(waits) == 6 and s.wait_mean_s == pytest.approx(sum(waits) / 6)
        assert min(waits) <= s.wait_p99_s <= max(waits)
        src.reset_stats()
        assert src.stats.fetches == 0 and src.stats.wait_p99_s == 0.0


def test_direct_rows_come_through_the_reader(table_file) -> None:
    path, offset, table = table_file
    n_rows, row_bytes = table.shape
    rng = np.random.default_rng()
    with PLERowSource(path, offset, row_bytes, n_rows, mode="direct", cache_rows=64) as src:
        reader = src._reader
        submitted: list[list[tuple[int, int]]] = []
        real_submit = reader.submit

        def spy(requests):
            submitted.append(list(requests))
            return real_submit(requests)

        reader.submit = spy
        ids = rng.choice(n_rows, size=16, replace=False)
        src.prefetch(ids)
        assert src.stats.rows_read == 16 and src.stats.bytes_read == 16 * row_bytes
        assert sorted(submitted[0]) == sorted((offset + int(r) * row_bytes, row_bytes) for r in ids)
        src.prefetch(ids)  # already on their way: nothing new is read
        assert len(submitted) == 1
        np.testing.assert_array_equal(src.rows(ids), table[ids])
        assert len(submitted) == 1 and src.stats.rows_read == 16  # served by the prefetch, not read again
        np.testing.assert_array_equal(src.rows(ids[::-1]), table[ids[::-1]])
        assert src.stats.cache_hits == 16 and len(submitted) == 1
        other = np.setdiff1d(np.arange(n_rows), ids)[:5]
        np.testing.assert_array_equal(src.rows(other), table[other])  # not prefetched: read on demand
        assert len(submitted) == 2 and src.stats.rows_read == 21
        assert reader.pending() == 0


def test_unclaimed_prefetches_are_absorbed(table_file) -> None:
    path, offset, table = table_file
    n_rows, row_bytes = table.shape
    # One reader thread works in submission order: once a later read is back, every prefetch before it is too.
    with PLERowSource(path, offset, row_bytes, n_rows, mode="direct", cache_rows=n_rows, workers=1) as src:
        for start in range(0, 160, 16):
            src.prefetch(np.arange(start, start + 16))
        src._reader.harvest(src._reader.submit([(0, 1)]), timeout=30)
        src.prefetch([0])
        assert not src._in_flight and src._reader.pending() == 0
        np.testing.assert_array_equal(src.rows(np.arange(160)), table[:160])
        assert src.stats.rows_read == 160 and src.stats.cache_hits == 160


def test_read_error_surfaces_and_the_rows_can_be_asked_again(table_file) -> None:
    path, offset, table = table_file
    n_rows, row_bytes = table.shape
    with PLERowSource(path, offset, row_bytes, n_rows, mode="direct") as src:
        data = path.read_bytes()
        os.truncate(path, offset + row_bytes)  # only row 0 remains
        src.prefetch([n_rows - 1])
        with pytest.raises(ReadError, match="shrank"):
            src.rows([n_rows - 1])
        assert not src._in_flight
        path.write_bytes(data)
        np.testing.assert_array_equal(src.rows([n_rows - 1]), table[[n_rows - 1]])


def test_invalid_tables_fail_at_construction(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    path = tmp_path / "ple.bin"
    offset, table = write_table(path, rng, 100, 1440)
    size = path.stat().st_size
    os.truncate(path, offset + 99 * 1440 + 100)  # shorter than the table the header describes
    for mode in MODES:
        with pytest.raises(ValueError, match="truncated"):
            PLERowSource(path, offset, 1440, 100, mode=mode)
    path.write_bytes(rng.integers(0, 256, size=size, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="positive"):
        PLERowSource(path, offset, 0, 100)
    with pytest.raises(ValueError, match="positive"):
        PLERowSource(path, offset, 1440, 0)
    with pytest.raises(ValueError, match="mode"):
        PLERowSource(path, offset, 1440, 100, mode="disk")
    with pytest.raises(ValueError, match="cache_rows"):
        PLERowSource(path, offset, 1440, 100, cache_rows=0)
    with pytest.raises(FileNotFoundError):
        PLERowSource(tmp_path / "absent.bin", 0, 1440, 100)
    with PLERowSource(path, offset, 1440, 100, mode="direct") as src:
        with pytest.raises(IndexError, match="outside"):
            src.rows([5, 100])
        with pytest.raises(IndexError, match="outside"):
            src.prefetch([-1])


@pytest.mark.parametrize("mode", MODES)
def test_only_ram_mode_copies_the_table(mode: str, tmp_path: Path) -> None:
    rng = np.random.default_rng()
    path = tmp_path / "ple.bin"
    offset, table = write_table(path, rng, 6000, 1440)  # 8.6 MB
    del table
    tracemalloc.start()
    try:
        with PLERowSource(path, offset, 1440, 6000, mode=mode, cache_rows=64) as src:
            for _ in range(10):
                ids = rng.integers(0, 6000, size=16)
                src.prefetch(ids)
                src.rows(ids)
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    if mode == "ram":
        assert peak >= 6000 * 1440
    else:
        assert peak < 6000 * 1440 // 8
