"""Tasks handed out one at a time from a shared counter, so that a slow core does less of a parallel loop.

Numba's prange splits its iterations between the threads before they start, in equal contiguous shares
(set_parallel_chunksize does not change that with the OpenMP layer: measured here, no faster with one core
shared). When one core runs slower than the other (a neighbour on a shared machine, an efficiency core, the
operating system), every region waits for the slow core's whole share. A region written as

    counter = task_counter()
    for worker in numba.prange(workers):   # workers = numba.get_num_threads(), passed in: one per thread
        task = next_task(counter)
        while task < n_tasks:
            ...                                    # task's work, writing only its own outputs
            task = next_task(counter)

lets each worker take the next task when it finishes one: the fast core takes more of them. Each task writes
its own outputs, so the results are the same bits whichever thread runs it. The thread count comes in as an
argument (numba.get_num_threads() called inside a kernel keeps the kernel out of Numba's disk cache). A loop of
64 equal tasks on 2 threads with a busy-looping process sharing one core (the other core free): 9.3 ms
statically split, 7.4 ms from the counter (the ideal is 7.1), the same 5.3 ms on a quiet machine. Where tasks
are small, a worker claims runs of them (`for first, end in claimed_runs(counter, n, workers, unit)`), a few
per worker, so the counter is taken a few times per region and not per task.
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["CLAIMS_PER_WORKER", "EXPERT_CLAIMS_PER_WORKER", "claim_size", "claimed_runs", "expert_unit", "fetch_add",
           "next_task", "publish", "task_counter", "thread_count", "wait_for", "worker_count"]


def _int64_vector(ty) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.int64 and ty.ndim == 1


def _slot(context, builder, sig, args):
    """The address of counter[i] (args (counter, i, ...))."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(ary.data, [context.cast(builder, args[1], sig.args[1], types.intp)])


def _atomic_add(ordering):
    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", _slot(context, builder, sig, args), value, ordering)
    return codegen


@intrinsic
def fetch_add(typingctx, counter, i, v):
    """Atomically add v to counter[i] (a 1-D int64 array) and return the value it held before."""
    if not _int64_vector(counter):
        return None
    # monotonic: the counter orders nothing else; each task's data comes from before the region and its
    # outputs are read after it (the region's end is the synchronization)
    return types.int64(counter, i, v), _atomic_add("monotonic")


@intrinsic
def publish(typingctx, counter, i, v):
    """fetch_add that also orders memory (acquire-release): this thread's writes before it are visible to a thread
    that reads the new count (wait_for), and the thread that makes the count complete sees every write that the
    other adders made before theirs. How a worker hands its outputs to another inside one region."""
    if not _int64_vector(counter):
        return None
    return types.int64(counter, i, v), _atomic_add("acq_rel")


@intrinsic
def _load_acquire(typingctx, counter, i):
    if not _int64_vector(counter):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot(context, builder, sig, args), "acquire", 8)
    return types.int64(counter, i), codegen


_PAUSE = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def _spin_pause(typingctx):
    """x86's pause (a spin loop's hint to the core: less power, no penalty on leaving it); nothing elsewhere."""
    def codegen(context, builder, sig, args):
        if _PAUSE:
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                        "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()
    return types.none(), codegen


@numba.njit(inline="always", nogil=True)
def wait_for(counter, i, target):
    """Spin until counter[i] >= target, a count another worker publishes; its writes before are then visible.

    Waiting inside a region cannot deadlock where every wait is for tasks already claimed from a counter and no
    task waits for a later one: a claimed task's worker runs it to the end (a worker claims nothing while it holds
    a claim), whether or not it shares a thread with others (prange may run two workers on one thread in turn)."""
    while _load_acquire(counter, i) < target:
        _spin_pause()


@intrinsic
def thread_count(typingctx):
    """The calling thread's Numba thread count, read inside a kernel through the symbol Numba's own parallel
    regions call (numba.get_num_threads() in a kernel goes through a pointer that keeps the kernel out of the
    disk cache; read from Python before each product it cost ~3.5 us, ~55 us with the caches cold after a
    token's weights streamed through them)."""
    numba.get_num_threads()  # starts Numba's thread pool, which registers the symbol

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(cgutils.intp_t, []), "get_num_threads")
        return builder.call(fn, [])
    return types.intp(), codegen


@numba.njit(inline="always", nogil=True)
def worker_count(workers):
    """workers, or the calling thread's thread count where workers <= 0 (what the decode's products pass)."""
    return workers if workers > 0 else thread_count()


@numba.njit(inline="always", nogil=True)
def task_counter():
    """A counter of tasks handed out, at zero."""
    return np.zeros(1, np.int64)


@numba.njit(inline="always", nogil=True)
def next_task(counter):
    """The next task not yet handed out (counts past the last one: callers stop at their task count)."""
    return fetch_add(counter, 0, 1)


# Claims per worker where tasks are small (a decoded token's products and experts): a claim is a contiguous run
# of items, so each core still streams long runs of memory and takes the counter a few times per region (a
# 16-row task of the 255 MB output head reads ~27 KB, ~1 us: an atomic shared between cores per task would cost
# a tenth of it).
CLAIMS_PER_WORKER = 8


@numba.njit(inline="always", nogil=True)
def claim_size(n, workers, unit):
    """Items per claim of n items shared by `workers` workers: about CLAIMS_PER_WORKER claims per worker, a
    multiple of unit."""
    per = (n + workers * CLAIMS_PER_WORKER - 1) // (workers * CLAIMS_PER_WORKER)
    return max(unit, (per + unit - 1) // unit * unit)


# Claims per worker below which an expert pool's claims split experts (expert_unit).
EXPERT_CLAIMS_PER_WORKER = 4


@numba.njit(inline="always", nogil=True)
def expert_unit(per_expert, k, workers):
    """The claim unit (for claimed_runs) of a decode pool's tasks, k experts of per_expert consecutive tasks each:
    whole experts where that still gives each worker EXPERT_CLAIMS_PER_WORKER claims, else an equal share of an
    expert (rounded down) small enough to. Each claim starts its streams of rows cold, and claim_size's runs cut
    experts across claims. 10 random experts of the 80B-shaped IQ2_XS file (planes) from RAM, 2 threads (a Xeon),
    claims of whole experts against claim_size's (20 tasks of gate/up, 80 of down), median time ratio over 37
    alternating rounds, two runs: gate/up 0.885 and 0.938, down 0.881 and 0.941 (half experts 0.926 / 0.895,
    quarter 1.025 / 0.979); the same reads without the dots, 16.5 GB/s against 14.5. The fused MoE block within a
    decode, alternating processes: 0.94x (median of 6 pairs)."""
    parts = max(1, (EXPERT_CLAIMS_PER_WORKER * workers + k - 1) // k)
    return max(1, per_expert // parts)


@numba.njit(nogil=True, fastmath=False)  # integer arithmetic only
def claimed_runs(counter, n, workers, unit):
    """The runs (first, end) of items 0 .. n - 1 that one worker claims from counter, claim_size(n, workers,
    unit) items each (the last one short), until none is left: a worker's loop is
    `for first, end in claimed_runs(...)`."""
    per = claim_size(n, workers, unit)
    c = next_task(counter)
    while c * per < n:
        yield c * per, min(n, (c + 1) * per)
        c = next_task(counter)
