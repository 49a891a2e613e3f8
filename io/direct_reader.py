"""Batched unbuffered file reads: a submission queue, a few reader threads, a completion queue.

The shape of io_uring in plain Python: `submit` hands over many (offset, length) reads at once and returns a
ticket at once; threads read them with `os.preadv` (which releases the GIL) on an O_DIRECT descriptor into
page-aligned buffers; `harvest(ticket)` waits for one ticket, `completions()` hands tickets back in the order
they finish. O_DIRECT reads bypass the page cache, so reading a few rows of a table far bigger than RAM
neither fills memory nor evicts what the rest of the engine keeps there.

O_DIRECT needs offsets, lengths and buffer addresses aligned to the device's logical block size. The reader
widens every read to `alignment` (4096 covers 512- and 4096-byte devices) and hands back exactly the bytes
asked for, as a view into the aligned buffer. Where the file system refuses O_DIRECT (EINVAL at open or at
the first read) the reader reads through the page cache instead, says so once in the log and reports
`mode == "buffered"`.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("strata_async.io")

DEFAULT_ALIGNMENT = 4096


class ReadError(OSError):
    """A submitted read failed in a reader thread; raised by `harvest`/`completions` for its ticket, whose id
    it carries as `ticket` (the ticket is no longer outstanding)."""

    ticket: int | None = None


@dataclass
class _Ticket:
    """One submitted batch: its buffer, the per-read results and what went wrong, if anything."""

    ticket_id: int
    n_reads: int
    buffer: mmap.mmap
    results: list[np.ndarray | None]
    # Mutable under the reader's lock: reads still outstanding and the first error a reader thread met.
    remaining: int
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class _Read:
    """One read as a reader thread performs it: the aligned span and where the asked-for bytes lie in it."""

    ticket: _Ticket
    index: int
    aligned_offset: int
    span: memoryview  # aligned slice of the ticket's buffer, len = aligned length
    skip: int  # asked-for bytes start this far into the span
    length: int  # asked-for length


class DirectReader:
    """Reads (offset, length) ranges of one file with O_DIRECT through `workers` threads.

    `queue_depth` bounds the reads submitted but not yet started; `submit` blocks while it is full (reads
    complete whether or not anybody harvests them, so it always makes progress). Not safe for submitting
    from several threads while another closes the reader; otherwise submit/harvest may be called from any
    thread.
    """

    def __init__(self, path: str | os.PathLike[str], workers: int = 4, queue_depth: int = 64,
                 alignment: int = DEFAULT_ALIGNMENT):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be at least 1, got {queue_depth}")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.path = os.fspath(path)
        self.alignment = alignment
        self._fd, self.mode = self._open(self.path, alignment)
        self.size = os.fstat(self._fd).st_size
        self._lock = threading.Lock()
        # Under _lock: tickets submitted and not yet handed back, finished ones in finishing order.
        self._outstanding: dict[int, _Ticket] = {}
        self._finished: list[int] = []
        self._finished_cv = threading.Condition(self._lock)
        self._next_ticket = 0
        self._closed = False
        self._submissions: queue.Queue[_Read | None] = queue.Queue(maxsize=queue_depth)
        self._threads = [threading.Thread(target=self._work, name=f"direct-reader-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    @staticmethod
    def _open(path: str, alignment: int) -> tuple[int, str]:
        """Open `path` for O_DIRECT reads, or buffered ones where the file system refuses O_DIRECT."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "no such file to read", path) from None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file; give the path of the data file")
        direct_flag = getattr(os, "O_DIRECT", 0)
        refusal: OSError | None = None
        fd = -1
        if direct_flag:
            try:
                fd = os.open(path, os.O_RDONLY | direct_flag)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                refusal = e
        if fd >= 0:
            # Some file systems accept the flag at open and refuse the first read: try one block now.
            probe = mmap.mmap(-1, alignment)
            try:
                os.preadv(fd, [probe], 0)
                return fd, "direct"
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EINVAL:
                    raise
                refusal = e
            finally:
                probe.close()
        log.info("O_DIRECT %s for %s (%s); reading through the page cache instead",
                 "refused" if refusal else "unavailable", path, refusal)
        return os.open(path, os.O_RDONLY), "buffered"

    def submit(self, requests: Sequence[tuple[int, int]]) -> int:
        """Queue reads of (offset, length) byte ranges; return the ticket that `harvest` takes.

        Raises ValueError for a range outside the file or a reader already closed."""
        reqs = [(int(o), int(n)) for o, n in requests]
        if self._closed:
            raise ValueError(f"reader for {self.path} is closed; open a new DirectReader")
        if not reqs:
            raise ValueError("submit needs at least one (offset, length) read")
        a = self.alignment
        spans = []
        total = 0
        for offset, length in reqs:
            if offset < 0 or length <= 0:
                raise ValueError(f"read ({offset}, {length}) needs offset >= 0 and length > 0")
            if offset + length > self.size:
                raise ValueError(f"read of {length} bytes at offset {offset} ends at {offset + length}, past the "
                                 f"end of {self.path} ({self.size} bytes)")
            start = offset // a * a
            end = -(-(offset + length) // a) * a
            spans.append((start, end - start, offset - start, length))
            total += end - start
        buffer = mmap.mmap(-1, total)  # anonymous mappings are page-aligned
        with self._lock:
            ticket = _Ticket(self._next_ticket, len(reqs), buffer, [None] * len(reqs), remaining=len(reqs))
            self._next_ticket += 1
            self._outstanding[ticket.ticket_id] = ticket
        view = memoryview(buffer)
        pos = 0
        for i, (start, span_len, skip, length) in enumerate(spans):
            self._submissions.put(_Read(ticket, i, start, view[pos:pos + span_len], skip, length))
            pos += span_len
        return ticket.ticket_id

    def _work(self) -> None:
        while (read := self._submissions.get()) is not None:
            try:
                data = self._read(read)
                error = None
            except BaseException as e:  # handed to whoever harvests the ticket; the thread keeps serving
                data, error = None, e
            self._complete(read, data, error)

    def _read(self, read: _Read) -> np.ndarray:
        want = read.skip + read.length
        got = 0
        while got < want:
            n = os.preadv(self._fd, [read.span[got:]], read.aligned_offset + got)
            if n == 0:
                raise ReadError(errno.EIO, f"{self.path} ended at byte {read.aligned_offset + got} while reading "
                                f"{read.length} bytes at offset {read.aligned_offset + read.skip}; the file "
                                "shrank after it was opened")
            got += n
        return np.frombuffer(read.span, dtype=np.uint8, count=read.length, offset=read.skip)

    def _complete(self, read: _Read, data: np.ndarray | None, error: BaseException | None) -> None:
        t = read.ticket
        with self._lock:
            t.results[read.index] = data
            if error is not None and t.error is None:
                t.error = error
            t.remaining -= 1
            if t.remaining == 0:
                t.done.set()
                self._finished.append(t.ticket_id)
                self._finished_cv.notify_all()

    def _hand_back(self, t: _Ticket) -> list[np.ndarray]:
        """The ticket's results (the caller removed it from the outstanding set), or its error raised."""
        if t.error is None:
            return t.results  # type: ignore[return-value]
        e = t.error
        if isinstance(e, ReadError):
            e.ticket = t.ticket_id
            raise e
        err = ReadError(getattr(e, "errno", None) or errno.EIO, f"read from {self.path} failed: {e}")
        err.ticket = t.ticket_id
        raise err from e

    def harvest(self, ticket: int, timeout: float | None = None) -> list[np.ndarray]:
        """Wait for a ticket; return one uint8 array per submitted read, in submission order.

        Raises TimeoutError when `timeout` seconds pass first (the ticket stays harvestable), KeyError for a
        ticket not outstanding (unknown, or already handed back), ReadError when one of its reads failed."""
        with self._lock:
            t = self._outstanding.get(ticket)
        if t is None:
            raise KeyError(f"ticket {ticket} is not outstanding (never submitted, or already handed back)")
        if not t.done.wait(timeout):
            raise TimeoutError(f"ticket {ticket}: {t.remaining} of {t.n_reads} reads still running after {timeout} s")
        with self._lock:
            if self._outstanding.pop(ticket, None) is None:
                raise KeyError(f"ticket {ticket} was handed back by another caller")
            self._finished.remove(ticket)
        return self._hand_back(t)

    def completions(self, timeout: float | None = None) -> Iterator[tuple[int, list[np.ndarray]]]:
        """Yield (ticket, arrays) for outstanding tickets in the order they finish, until none is outstanding
        or `timeout` seconds have passed (timeout=0: only those already finished). A ticket whose read failed
        raises ReadError when its turn comes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                while not self._finished:
                    if not self._outstanding:
                        return
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return
                    self._finished_cv.wait(left)
                ticket_id = self._finished.pop(0)
                t = self._outstanding.pop(ticket_id)
            yield ticket_id, self._hand_back(t)

    def pending(self) -> int:
        """Tickets submitted and not yet handed back."""
        with self._lock:
            return len(self._outstanding)

    def close(self) -> None:
        """Finish the reads already submitted, stop the threads and close the file. Tickets that finished stay
        harvestable."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._submissions.put(None)
        for t in self._threads:
            t.join()
        os.close(self._fd)

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
