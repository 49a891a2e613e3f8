"""The threads that share a prompt's matrix products: BLAS runs single-threaded and these split the tiles.

OpenBLAS's own worker threads spin for ~0.1 s after every product before they sleep, and prompt processing
runs parallel Numba kernels between products (the DeltaNet rule, attention, activation rounding): each such
kernel shared its cores with spinning BLAS threads (the DeltaNet rule ran 15 ms alone and 27-37 ms right after a
product). So BLAS is limited to one thread, once, and quant.matmul hands each of these threads its share of the
weight tiles: a thread decodes a tile (Numba, without the GIL) and multiplies it (numpy releases the GIL in
BLAS), so one thread's decode overlaps the other's product. A 512-token prompt of the synthetic 80B Q4_K file:
~10% faster with float activations (bench/README.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_blas_limited = False


def _single_threaded_blas() -> None:
    """Limit every BLAS library numpy has loaded to one thread (once per process)."""
    global _blas_limited
    if _blas_limited:
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
    _blas_limited = True


def run_parts(work: Callable[[int, int], None]) -> None:
    """Call work(part, parts) for part in range(parts), parts = the calling thread's Numba thread count: part 0
    on the calling thread, the others on pool threads; returns when all are done (their errors re-raised)."""
    global _pool
    parts = numba.get_num_threads()
    with _lock:
        _single_threaded_blas()
        if parts > 1 and _pool is None:  # parts never exceeds Numba's thread count
            _pool = ThreadPoolExecutor(max_workers=numba.config.NUMBA_NUM_THREADS - 1, thread_name_prefix="tiles")
    futures = [_pool.submit(work, part, parts) for part in range(1, parts)] if parts > 1 else []
    try:
        work(0, parts)
    finally:
        for f in futures:
            f.result()
