"""The engine's allocator policy (runtime/host_memory.py): buffers a step frees are mapped again for the next."""

import platform
import resource

import numpy as np
import pytest

from strata_async.runtime.host_memory import keep_freed_buffers

BUFFER = 64 << 20  # above glibc's largest default mmap threshold (32 MiB): mapped fresh on every allocation


def _minor_faults_of_a_buffer() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf = np.ones(BUFFER, np.uint8)  # written whole: every page touched
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del buf
    return faults


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_buffers_come_back_without_page_faults():
    assert keep_freed_buffers()
    _minor_faults_of_a_buffer()  # faults its pages in, or finds them kept by an earlier test
    again = [_minor_faults_of_a_buffer() for _ in range(3)]
    pages = BUFFER // resource.getpagesize()
    # mapped fresh, a buffer takes a fault per page, or at least one per 2 MiB with transparent huge pages (32)
    assert max(again) < 16, f"{again} page faults for a buffer of {pages} pages"
