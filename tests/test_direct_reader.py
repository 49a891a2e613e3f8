"""DirectReader against plain buffered reads of the same bytes: unaligned ranges, concurrency, the buffered
fallback, errors."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from strata_async.io import DirectReader, ReadError
from strata_async.io import direct_reader as direct_reader_module

# tmp_path lies on the repository's disk; /dev/shm is tmpfs, which some kernels let O_DIRECT through and some
# refuse: each location's expected mode comes from probing it directly.
LOCATIONS = ["tmp_path", "/dev/shm"]


def o_direct_works(path: Path) -> bool:
    """Whether this file can be opened with O_DIRECT and an aligned block read from it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    buf = mmap.mmap(-1, 4096)
    try:
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()


@pytest.fixture(params=LOCATIONS)
def data_file(request: pytest.FixtureRequest, tmp_path: Path):
    """A random file of a size that is no multiple of 4096, and its bytes."""
    rng = np.random.default_rng()
    data = rng.integers(0, 256, size=int(rng.integers(300_000, 400_000)), dtype=np.uint8).tobytes()
    base = tmp_path if request.param == "tmp_path" else Path(request.param)
    if not base.is_dir():
        pytest.fail(f"{base} missing: the test needs it")
    path = base / f"direct-reader-{os.getpid()}-{threading.get_ident()}-{rng.integers(1 << 30)}.bin"
    path.write_bytes(data)
    yield path, data
    path.unlink()


def random_reads(rng: np.random.Generator, size: int, n: int) -> list[tuple[int, int]]:
    reads = []
    for _ in range(n):
        length = int(rng.integers(1, 20_000))
        reads.append((int(rng.integers(0, size - length + 1)), length))
    reads += [(0, 1), (size - 1, 1), (0, size), (4095, 2)]  # the edges and a read straddling one block boundary
    return reads


def test_unaligned_reads_match_plain_reads(data_file) -> None:
    path, data = data_file
    rng = np.random.default_rng()
    with DirectReader(path) as reader:
        assert reader.mode == ("direct" if o_direct_works(path) else "buffered")
        if reader.mode == "direct":
            assert fcntl.fcntl(reader._fd, fcntl.F_GETFL) & os.O_DIRECT
        reads = random_reads(rng, len(data), 200)
        out = reader.harvest(reader.submit(reads), timeout=60)
    assert len(out) == len(reads)
    for (offset, length), got in zip(reads, out):
        assert got.dtype == np.uint8 and got.shape == (length,)
        assert got.tobytes() == data[offset:offset + length]
        # the view starts where the asked-for byte lies in a block-aligned buffer
        assert (got.ctypes.data - offset % 4096) % 4096 == 0


def test_many_concurrent_submits(data_file) -> None:
    path, data = data_file
    failures: list[str] = []
    with DirectReader(path, workers=4, queue_depth=8) as reader:
        def client(seed: int) -> None:
            rng = np.random.default_rng(seed)
            tickets = [(reader.submit(reads), reads) for reads in
                       (random_reads(rng, len(data), int(rng.integers(1, 30))) for _ in range(25))]
            for ticket, reads in reversed(tickets):
                for (offset, length), got in zip(reads, reader.harvest(ticket, timeout=60)):
                    if got.tobytes() != data[offset:offset + length]:
                        failures.append(f"ticket {ticket}: read ({offset}, {length}) differs")

        seeds = np.random.default_rng().integers(1 << 32, size=6)
        threads = [threading.Thread(target=client, args=(int(s),)) for s in seeds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert reader.pending() == 0
    assert failures == []


def test_completions_hand_back_every_ticket_once(data_file) -> None:
    path, data = data_file
    rng = np.random.default_rng()
    with DirectReader(path, workers=3) as reader:
        submitted = {}
        for _ in range(40):
            reads = random_reads(rng, len(data), int(rng.integers(1, 10)))
            submitted[reader.submit(reads)] = reads
        seen = []
        for ticket, arrays in reader.completions(timeout=30):
            seen.append(ticket)
            assert [a.tobytes() for a in arrays] == [data[o:o + n] for o, n in submitted[ticket]]
        assert sorted(seen) == sorted(submitted)
        assert list(reader.completions(timeout=0)) == []
        with pytest.raises(KeyError, match="not outstanding"):
            reader.harvest(seen[0])


def test_queue_depth_one_still_completes_large_batches(data_file) -> None:
    path, data = data_file
    rng = np.random.default_rng()
    with DirectReader(path, workers=2, queue_depth=1) as reader:
        reads = random_reads(rng, len(data), 300)
        out = reader.harvest(reader.submit(reads), timeout=60)
    assert all(got.tobytes() == data[o:o + n] for (o, n), got in zip(reads, out))


def test_close_joins_workers_and_refuses_new_reads(data_file) -> None:
    path, data = data_file
    reader = DirectReader(path, workers=3)
    ticket = reader.submit([(10, 100)])
    reader.close()
    assert not any(t.is_alive() for t in reader._threads)
    assert reader.harvest(ticket)[0].tobytes() == data[10:110]  # finished before close returned
    with pytest.raises(ValueError, match="closed"):
        reader.submit([(0, 1)])
    reader.close()  # closing twice is harmless


def test_bad_requests_fail_at_submit(data_file) -> None:
    path, data = data_file
    with DirectReader(path) as reader:
        with pytest.raises(ValueError, match="past the end"):
            reader.submit([(0, 10), (len(data) - 5, 6)])
        with pytest.raises(ValueError, match="offset >= 0"):
            reader.submit([(-1, 10)])
        with pytest.raises(ValueError, match="length > 0"):
            reader.submit([(0, 0)])
        with pytest.raises(ValueError, match="at least one"):
            reader.submit([])
        assert reader.pending() == 0


def test_missing_or_unreadable_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        DirectReader(tmp_path / "absent.bin")
    with pytest.raises(ValueError, match="not a regular file"):
        DirectReader(tmp_path)
    with pytest.raises(ValueError, match="workers"):
        DirectReader(tmp_path / "absent.bin", workers=0)


def test_file_shrinking_after_open_is_an_error_at_harvest(data_file) -> None:
    path, data = data_file
    with DirectReader(path, workers=2) as reader:
        os.truncate(path, 10_000)
        bad = reader.submit([(0, 100), (len(data) - 1000, 1000)])
        with pytest.raises(ReadError, match="shrank") as info:
            reader.harvest(bad, timeout=30)
        assert info.value.ticket == bad
        # the reader threads survived: the bytes still there read fine
        assert reader.harvest(reader.submit([(5, 50)]), timeout=30)[0].tobytes() == data[5:55]
        bad = reader.submit([(len(data) - 10, 10)])
        with pytest.raises(ReadError):
            list(reader.completions(timeout=30))
        assert reader.pending() == 0


def refuse_o_direct_at_open(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def open_without_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_reader_module.os, "open", open_without_direct)


def refuse_o_direct_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    real_preadv = os.preadv

    def preadv_without_direct(fd, buffers, offset, *args):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(direct_reader_module.os, "preadv", preadv_without_direct)


@pytest.mark.parametrize("refuse", [refuse_o_direct_at_open, refuse_o_direct_reads])
def test_buffered_fallback_where_o_direct_is_refused(refuse, data_file, monkeypatch, caplog) -> None:
    path, data = data_file
    refuse(monkeypatch)
    rng = np.random.default_rng()
    with caplog.at_level(logging.INFO, logger="strata_async.io"):
        with DirectReader(path) as reader:
            assert reader.mode == "buffered"
            assert not fcntl.fcntl(reader._fd, fcntl.F_GETFL) & os.O_DIRECT
            for _ in range(3):
                reads = random_reads(rng, len(data), 50)
                out = reader.harvest(reader.submit(reads), timeout=60)
                assert all(got.tobytes() == data[o:o + n] for (o, n), got in zip(reads, out))
    said = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0].getMessage()
