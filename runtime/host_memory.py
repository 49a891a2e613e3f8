"""The host allocator's policies: freed working buffers kept for the next step; weights on huge pages.

A prompt chunk's forward pass allocates buffers of tens of megabytes and frees them at the end of each step: per
layer, the grouped experts' outputs [pairs, hidden] (512 tokens x top-10 x 2048 floats: 42 MB), their SwiGLU
outputs and token codes, every projection's output [tokens, rows] (up to 25 MB). glibc's malloc serves each
allocation above its mmap threshold (dynamic, at most 32 MiB) with fresh pages from the kernel and unmaps it on
free, and gives the top of its heap back past a trim threshold: so every layer of every step faulted its buffers
in again, a page (or a 2 MiB huge page) at a time, with both threads waiting on the kernel. Raising both
thresholds keeps the freed memory in the heap, where the next layer's buffers find it already mapped. On a
2-core AMD EPYC, a 512-token prefill of the 4-layer IQ2_XS file with 80B shapes (integer path), four alternating
processes each way, median of each process's five prefills after the first: 1025-1175 ms -> 962-1065 ms (median
of them 1078 -> 965).

The cost: memory a step freed stays with the process (up to KEEP_BYTES at the top of the heap) instead of going
back to the system between steps; its peak is what the steps needed anyway.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import platform

import numpy as np

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # allocations below this come from the heap; this much free at its top is kept

_applied = False


def keep_freed_buffers() -> bool:
    """Set glibc's malloc to serve allocations below KEEP_BYTES from its heap and keep up to KEEP_BYTES of freed
    memory mapped (once a process). Returns whether the policy is in force: False where the C library is not
    glibc or refuses the settings, which leaves the allocator as it was (correct, only slower prefills)."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting it also stops glibc's dynamic adjustment of both thresholds
    _applied = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    return _applied


# Transparent huge pages: a weight matrix read whole every token spans thousands of 4 KiB pages, each a TLB miss
# of its own, where 2 MiB pages take one per 512 of them. The weights the engine copies at load (repacked planes,
# runtime/weights.py's huge-page copies) are placed so: start aligned to HUGE_PAGE, the range asked to be backed by
# huge pages (madvise MADV_HUGEPAGE, which the kernel honours where transparent huge pages are "madvise" or
# "always"). A file's own mapping gets huge pages only as its page cache happens to hold them (large folios,
# written recently: a fresh synthetic file was 95% PMD-mapped, one read back hours later 6-14%).
HUGE_PAGE = 2 << 20


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"  # e.g. "always [madvise] never": the one in brackets


def huge_pages_advisable() -> bool:
    """Whether this system gives transparent huge pages where asked: Linux with MADV_HUGEPAGE, its setting "always"
    or "madvise" (not "never"; a kernel without the setting has no transparent huge pages)."""
    if platform.system() != "Linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_array(shape: tuple[int, ...]) -> np.ndarray:
    """A new uint8 array of this shape (contents unset, zero pages until written) in anonymous memory whose first
    byte is HUGE_PAGE-aligned and whose range is advised to be backed by transparent huge pages where the system
    has them (huge_pages_advisable); elsewhere a plain anonymous mapping. The array keeps its mapping alive, and
    the mapping goes back to the system when the last view of it is freed."""
    n = math.prod(shape)
    size = n + HUGE_PAGE  # room to move the start to a huge page boundary; the slack is never touched
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = np.frombuffer(area, np.uint8)
    start = -flat.ctypes.data % HUGE_PAGE
    if huge_pages_advisable():
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without transparent huge pages: 4 KiB pages, as np.empty gives
            pass
    return flat[start:start + n].reshape(shape)
