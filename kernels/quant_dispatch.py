"""One compiled entry point for every ggml format, so the kernels cache on disk.

Kernels specialised per format by closures would be recompiled in every process (Numba cannot
cache closures); a branch on the type id per row costs nothing next to decoding the row, and lets
``dequant_rows`` and ``matvec`` below be compiled once and loaded from Numba's cache afterwards.
"""

import numba
import numpy as np

from .quant_float import BF16, F16, F32, dequant_bf16, dequant_f16, dequant_f32, dot_bf16, dot_f16
from .quant_iq import (IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, dequant_iq1_m, dequant_iq1_s,
                       dequant_iq2_s, dequant_iq2_xs, dequant_iq2_xxs, dequant_iq3_s, dequant_iq3_xxs, dot_iq2_xs,
                       dot_iq1_m, dot_iq1_s, dot_iq2_s, dot_iq2_xxs, dot_iq3_s, dot_iq3_xxs, idot_iq1_m, idot_iq1_s,
                       idot_iq2_s, idot_iq2_xs, idot_iq2_xxs, idot_iq3_s, idot_iq3_xxs)
from .quant_k import (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, dequant_q2_k, dequant_q3_k, dequant_q4_k, dequant_q5_k,
                      dequant_q6_k, dot_q2_k, dot_q3_k)
from .quant_legacy import (Q2_0, Q4_0, Q4_1, Q5_0, Q5_1, dequant_q2_0, dequant_q4_0, dequant_q4_1, dequant_q5_0,
                           dequant_q5_1, dot_q2_0, dot_q4_0, dot_q4_1, dot_q5_0, dot_q5_1)
from .quant_dot import block_sums32, dot_q4_k, dot_q5_k, dot_q6_k, dot_q8_0
from .quant_int import (idot_iq4_nl, idot_iq4_xs, idot_mxfp4, idot_q2_0, idot_q2_k, idot_q3_k, idot_q4_0, idot_q4_1,
                        idot_q4_k, idot_q5_0, idot_q5_1, idot_q5_k, idot_q6_k, idot_q8_0, q8_activations)
from .simd import IS_INTEL, fdot_f32_64, prefetch
from .quant_nl import (IQ4_NL, IQ4_XS, MXFP4, dequant_iq4_nl, dequant_iq4_xs, dequant_mxfp4, dot_iq4_nl,
                       dot_iq4_xs, dot_mxfp4)
from .quant_planes import (IQ2_XS_PLANES, dequant_planes, dot_planes, idot_planes, planes_order_f32,
                           planes_order_i8)
from .quant_q8 import Q8_0, dequant_q8_0
from .task_queue import claimed_runs, task_counter, worker_count

# Reassociation lets LLVM vectorize the dot product (float32 lanes); rounding differs from a
# sequential sum by far less than the tolerances of the float64 reference tests.
_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_row(t, src, dst):
    """Decode one row of ggml type ``t`` (``src``: its bytes) into float32 ``dst``."""
    if t == Q8_0:
        dequant_q8_0(src, dst)
    elif t == Q4_K:
        dequant_q4_k(src, dst)
    elif t == Q6_K:
        dequant_q6_k(src, dst)
    elif t == F32:
        dequant_f32(src, dst)
    elif t == F16:
        dequant_f16(src, dst)
    elif t == BF16:
        dequant_bf16(src, dst)
    elif t == Q2_K:
        dequant_q2_k(src, dst)
    elif t == Q3_K:
        dequant_q3_k(src, dst)
    elif t == Q5_K:
        dequant_q5_k(src, dst)
    elif t == Q4_0:
        dequant_q4_0(src, dst)
    elif t == Q4_1:
        dequant_q4_1(src, dst)
    elif t == Q5_0:
        dequant_q5_0(src, dst)
    elif t == Q5_1:
        dequant_q5_1(src, dst)
    elif t == Q2_0:
        dequant_q2_0(src, dst)
    elif t == IQ4_NL:
        dequant_iq4_nl(src, dst)
    elif t == IQ4_XS:
        dequant_iq4_xs(src, dst)
    elif t == MXFP4:
        dequant_mxfp4(src, dst)
    elif t == IQ2_XXS:
        dequant_iq2_xxs(src, dst)
    elif t == IQ2_XS:
        dequant_iq2_xs(src, dst)
    elif t == IQ2_XS_PLANES:
        dequant_planes(src, dst)
    elif t == IQ2_S:
        dequant_iq2_s(src, dst)
    elif t == IQ3_XXS:
        dequant_iq3_xxs(src, dst)
    elif t == IQ3_S:
        dequant_iq3_s(src, dst)
    elif t == IQ1_S:
        dequant_iq1_s(src, dst)
    elif t == IQ1_M:
        dequant_iq1_m(src, dst)
    else:
        raise ValueError("ggml type has no decoder")


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=False)
def dequant_rows(t, w, out):
    """Decode rows ``w`` [rows, row_bytes] of type ``t`` into ``out`` [rows, k], rows in parallel."""
    for r in numba.prange(w.shape[0]):
        dequant_row(t, w[r], out[r])


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_rows_serial(t, w, out):
    """dequant_rows on the calling thread: for matmul's tiles, each a few tens of microseconds of decoding between
    two BLAS calls, where waking the parallel workers would cost more (and their idle spinning would take cores
    from BLAS's threads)."""
    for r in range(w.shape[0]):
        dequant_row(t, w[r], out[r])


# Rows a matrix-vector loop requests ahead of the one it dots, on Intel cores only. The hardware prefetchers stop at
# every 4 KiB page, so a stream of rows from RAM can stall at each page start. Intel (a Xeon with AVX-512, 2 cores
# reading 33 GB/s): the row ~2 KiB ahead (the next one of the head) into L1 (simd.prefetch): the head matrix alone
# from RAM on 2 threads 23.6-24.1 -> 25.0-28.3 GB/s, a 100000 x 2048 Q4_K matrix 20.1 -> 25.7 GB/s, where requests
# into L2 as well read 21.6-21.7 (Q6_K) and 4 KiB ahead into L1 19.2-21.6 (alternating processes). A row longer than
# a page is not requested: the row's 68+ requests at once (Q8_0, 4096 values) hold up the loads. On a Xeon with
# AVX-512 VBMI (480 MiB L3), 2 threads, matrices on huge pages read from RAM (a 1 GiB read before each call), the
# next row into L1 against none, alternating, median time ratio requests / none in two runs: the F32 router
# 512 x 2048 (8 KiB rows, 192 pairs) 1.063 and 1.094, Q8_0 4096 x 4096 (64 pairs) 1.059 and 1.077.
# AMD (Zen 4, 2 vCPUs) requests nothing. Requests into L2 about 32 KiB ahead had been measured there with the memory
# at 30-37 GB/s, the matrices in a file mapping, median time ratio requests / none: rows longer than 2 KiB slower
# (Q8_0 4096 x 4096 1.31, Q6_K 4096 x 4096 1.22, Q4_K 4096 x 4096 1.04, Q8_0 12288 x 2048 1.19, the router 1.18),
# rows of 2048 values either way (Q4_K 12288 x 2048 0.95, the Q6_K head 0.82 and 1.02). With the memory at 35-70
# GB/s, alternating processes, none was faster for every size: the Q8_0 head (2176-byte rows) 0.75-0.79 (6 pairs),
# the Q6_K head (1680) 0.86-0.92 (18 pairs), a Q4_K matrix of the head's shape (1152) 0.90-0.91 (8 pairs), the
# fused IQ2_XS MoE block (planes rows of 848 and 212 bytes) 0.94-0.95 (10 pairs); and IQ2_XS decode rounds,
# alternating, each step against a read of its bytes: 72.1%, 73.2%, 75.0% without the requests, 69.4%, 69.5% with.
ROWS_REQUESTED = IS_INTEL
L1_PREFETCH_BYTES = 2048
PREFETCH_MAX_ROW_BYTES = 4096
# Rows per task of the expert pools and the fused MoE block (float_dots / int_dots take a task's rows in one call),
# and the unit of a matrix-vector product's runs of rows (task_queue.claimed_runs).
ROW_TASK = 16


@numba.njit(inline="always", nogil=True)
def rows_ahead(w):
    """How many rows ahead prefetch_row requests in w (uint8 [rows, row bytes]): the row L1_PREFETCH_BYTES on
    where the cores are Intel's, or 0 (none) where a row is longer than a page or the cores are not Intel's.
    Worked out once a call, before the row loop: written inside it, the division stayed there, one a row (planes
    rows of 512 values from the cache, one thread: 1.03x as fast out of the loop, 1.01x for rows of 2048)."""
    if not ROWS_REQUESTED or w.shape[1] > PREFETCH_MAX_ROW_BYTES:
        return 0
    return max(1, L1_PREFETCH_BYTES // w.shape[1])


@numba.njit(inline="always", nogil=True)
def prefetch_row(w, r, ahead):
    """Request row r + ahead of w into L1 (ahead from rows_ahead; 0: none) if there is one."""
    if ahead > 0 and r + ahead < w.shape[0]:
        prefetch(w[r + ahead], 0, w.shape[1])


@numba.njit(nogil=True, inline="always", fastmath=_FASTMATH)
def _dot(a, b):
    """Dot product of two float32 vectors: 64-value chunks in vector lanes, the tail in a loop."""
    n64 = a.shape[0] // 64
    acc = fdot_f32_64(a, b, n64)
    for i in range(64 * n64, a.shape[0]):
        acc += a[i] * b[i]
    return acc


@numba.njit(nogil=True, fastmath=False)
def has_fused_dot(t):
    """Types whose rows are dotted with the activations straight from the blocks (quant_dot, quant_iq,
    quant_k, quant_legacy, quant_nl), F32, F16 and BF16 rows straight from their bytes (quant_float)."""
    return (t == Q8_0 or t == Q3_K or t == Q4_K or t == Q5_K or t == Q6_K or t == IQ2_XS or t == IQ2_XXS
            or t == IQ2_S or t == IQ3_XXS or t == IQ3_S or t == IQ1_S or t == IQ1_M or t == IQ4_NL
            or t == IQ4_XS or t == MXFP4 or t == Q4_0 or t == Q4_1 or t == Q5_0 or t == Q5_1 or t == Q2_K
            or t == Q2_0 or t == F32 or t == F16 or t == BF16 or t == IQ2_XS_PLANES)


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _f32_dot(src, x, xsum32):
    return _dot(src.view(np.float32), x)


def _float_rows(dot):
    """rows(w, r0, r1, x, xsum32, out, o0): out[o0 + r - r0] = dot(row r of w, x, xsum32) for r0 <= r < r1, rows
    requested ahead as rows_ahead says. A function of its own for each type, called (not inlined) from
    float_dots: inlined, every type's row loop landed in every kernel that dispatches on the type (the fused MoE
    block has several such calls), and Numba's passes over those kernels grew to minutes."""
    @numba.njit(nogil=True, fastmath=_FASTMATH)
    def rows(w, r0, r1, x, xsum32, out, o0):
        ahead = rows_ahead(w)
        for r in range(r0, r1):
            prefetch_row(w, r, ahead)
            out[o0 + r - r0] = dot(w[r], x, xsum32)
    return rows


_rows_dot_q4_k = _float_rows(dot_q4_k)
_rows_dot_q6_k = _float_rows(dot_q6_k)
_rows_dot_q5_k = _float_rows(dot_q5_k)
_rows_dot_q3_k = _float_rows(dot_q3_k)
_rows_dot_iq4_xs = _float_rows(dot_iq4_xs)
_rows_dot_iq4_nl = _float_rows(dot_iq4_nl)
_rows_dot_mxfp4 = _float_rows(dot_mxfp4)
_rows_dot_q4_0 = _float_rows(dot_q4_0)
_rows_dot_q4_1 = _float_rows(dot_q4_1)
_rows_dot_q5_0 = _float_rows(dot_q5_0)
_rows_dot_q5_1 = _float_rows(dot_q5_1)
_rows_dot_iq2_xs = _float_rows(dot_iq2_xs)
_rows_dot_iq2_xxs = _float_rows(dot_iq2_xxs)
_rows_dot_iq3_xxs = _float_rows(dot_iq3_xxs)
_rows_dot_iq2_s = _float_rows(dot_iq2_s)
_rows_dot_iq3_s = _float_rows(dot_iq3_s)
_rows_dot_iq1_s = _float_rows(dot_iq1_s)
_rows_dot_iq1_m = _float_rows(dot_iq1_m)
_rows_dot_q2_k = _float_rows(dot_q2_k)
_rows_dot_q2_0 = _float_rows(dot_q2_0)
_rows__f32_dot = _float_rows(_f32_dot)
_rows_dot_f16 = _float_rows(dot_f16)
_rows_dot_bf16 = _float_rows(dot_bf16)
_rows_dot_q8_0 = _float_rows(dot_q8_0)


@numba.njit(nogil=True, fastmath=_FASTMATH)
def _rows_dot_planes(w, r0, r1, x, xsum32, out, o0):
    """_float_rows for IQ2_XS_PLANES: x in the planes' value order already (float_ready)."""
    ahead = rows_ahead(w)
    for r in range(r0, r1):
        prefetch_row(w, r, ahead)
        out[o0 + r - r0] = dot_planes(w[r], x)


@numba.njit(inline="always", nogil=True)
def float_ready(t, x):
    """float32 activations (1-D; whole 256-value blocks for IQ2_XS_PLANES) as float_dots takes them for type t:
    in the planes' value order for IQ2_XS_PLANES (a new array, made once per input as int_ready's codes: ordered
    in each call of rows, the MoE block's tasks had ordered x twice for every 16 rows), as they are for every
    other type."""
    if t == IQ2_XS_PLANES:
        return planes_order_f32(x)
    return x


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _decoded_rows(t, w, r0, r1, x, scratch, out, o0):
    ahead = rows_ahead(w)
    for r in range(r0, r1):
        prefetch_row(w, r, ahead)
        dequant_row(t, w[r], scratch)
        out[o0 + r - r0] = _dot(scratch, x)


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def float_dots(t, w, r0, r1, x, xsum32, scratch, out, o0):
    """out[o0 + r - r0] = row r of w times float32 x (as float_ready(t) gives it) for r0 <= r < r1, rows requested
    ahead as rows_ahead says: fused block dots where the type has them (xsum32: x's per-32 sums, from
    block_sums32), else each row decoded into scratch (float32, a row long) and dotted. The type's branch is taken
    once a call, not once a row: with it inside the row loop (every type's dot inlined in one loop body) the integer
    dots ran 25-30% slower. Every row dot takes (src, x, xsum32), the integer ones (src, xq, xd, xs16), used or not:
    Numba's inlining binds each branch's call to its function."""
    if t == Q4_K:
        _rows_dot_q4_k(w, r0, r1, x, xsum32, out, o0)
    elif t == Q6_K:
        _rows_dot_q6_k(w, r0, r1, x, xsum32, out, o0)
    elif t == Q5_K:
        _rows_dot_q5_k(w, r0, r1, x, xsum32, out, o0)
    elif t == Q3_K:
        _rows_dot_q3_k(w, r0, r1, x, xsum32, out, o0)
    elif t == IQ4_XS:
        _rows_dot_iq4_xs(w, r0, r1, x, xsum32, out, o0)
    elif t == IQ4_NL:
        _rows_dot_iq4_nl(w, r0, r1, x, xsum32, out, o0)
    elif t == MXFP4:
        _rows_dot_mxfp4(w, r0, r1, x, xsum32, out, o0)
    elif t == Q4_0:
        _rows_dot_q4_0(w, r0, r1, x, xsum32, out, o0)
    elif t == Q4_1:
        _rows_dot_q4_1(w, r0, r1, x, xsum32, out, o0)
    elif t == Q5_0:
        _rows_dot_q5_0(w, r0, r1, x, xsum32, out, o0)
    elif t == Q5_1:
        _rows_dot_q5_1(w, r0, r1, x, xsum32, out, o0)
    elif t == IQ2_XS:
        _rows_dot_iq2_xs(w, r0, r1, x, xsum32, out, o0)
    elif t == IQ2_XS_PLANES:
        _rows_dot_planes(w, r0, r1, x, xsum32, out, o0)
    elif t == IQ2_XXS:
        _rows_dot_iq2_xxs(w, r0, r1, x, xsum32, out, o0)
    elif t == IQ3_XXS:
        _rows_dot_iq3_xxs(w, r0, r1, x, xsum32, out, o0)
    elif t == IQ2_S:
        _rows_dot_iq2_s(w, r0, r1, x, xsum32, out, o0)
    elif t == IQ3_S:
        _rows_dot_iq3_s(w, r0, r1, x, xsum32, out, o0)
    elif t == IQ1_S:
        _rows_dot_iq1_s(w, r0, r1, x, xsum32, out, o0)
    elif t == IQ1_M:
        _rows_dot_iq1_m(w, r0, r1, x, xsum32, out, o0)
    elif t == Q2_K:
        _rows_dot_q2_k(w, r0, r1, x, xsum32, out, o0)
    elif t == Q2_0:
        _rows_dot_q2_0(w, r0, r1, x, xsum32, out, o0)
    elif t == F32:
        _rows__f32_dot(w, r0, r1, x, xsum32, out, o0)
    elif t == F16:
        _rows_dot_f16(w, r0, r1, x, xsum32, out, o0)
    elif t == BF16:
        _rows_dot_bf16(w, r0, r1, x, xsum32, out, o0)
    elif t == Q8_0:
        _rows_dot_q8_0(w, r0, r1, x, xsum32, out, o0)
    else:
        _decoded_rows(t, w, r0, r1, x, scratch, out, o0)


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _matvec_rows(t, w, x, out, workers):
    """out = W @ x, W given as rows of ggml blocks (float_dots), in claims of contiguous rows that `workers`
    workers take from a counter (task_queue). prange: parallel in matvec, a plain loop in matvec_serial."""
    n_rows = w.shape[0]
    xsum32 = np.empty(max(1, x.shape[0] // 32), np.float32)
    if x.shape[0] % 32 == 0:
        block_sums32(x, xsum32)
    fused = has_fused_dot(t)
    xr = float_ready(t, x)
    counter = task_counter()
    for worker in numba.prange(workers):
        scratch = xsum32 if fused else np.empty(x.shape[0], np.float32)  # an allocation only where it is used
        for r0, r1 in claimed_runs(counter, n_rows, workers, ROW_TASK):
            float_dots(t, w, r0, r1, xr, xsum32, scratch, out, r0)


# fastmath here too: inlined dots take the flags of the function they are compiled into.
@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def matvec(t, w, x, out, workers):
    """out = W @ x over `workers` worker threads (<= 0: the calling thread's Numba thread count)."""
    _matvec_rows(t, w, x, out, worker_count(workers))


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH)
def matvec_serial(t, w, x, out):
    """out = W @ x on the calling thread: for small matrices, where waking the workers costs more than the
    product (idle workers sleep, see kernels/__init__.py)."""
    _matvec_rows(t, w, x, out, 1)


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def matmul_rows(t, w, x, out):
    """out [n, rows] = x [n, k] @ W.T for a few tokens: each row decoded once into a scratch row, then
    dotted with every token. Below ~16 tokens this beats decoding tiles for BLAS, whose cost per weight
    barely falls with fewer tokens (a routed expert in a prompt chunk often sees only a handful)."""
    n, k = x.shape
    n_rows = w.shape[0]
    n_chunks = min(n_rows, 64)
    per = (n_rows + n_chunks - 1) // n_chunks
    for c in numba.prange(n_chunks):
        buf = np.empty(k, np.float32)
        for r in range(c * per, min(n_rows, (c + 1) * per)):
            dequant_row(t, w[r], buf)
            for j in range(n):
                out[j, r] = _dot(buf, x[j])


# Types with an integer dot product against ggml-quantized activations (int_dots' branches).
INT_DOT_TYPES = frozenset({Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
                           IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, MXFP4, Q2_K, Q2_0, IQ2_XS_PLANES})


def has_int_dot(t: int) -> bool:
    """Whether type t has an integer dot (asked from Python before each product: a set, not a kernel call)."""
    return t in INT_DOT_TYPES


def _int_rows(dot):
    """rows(w, r0, r1, xq, xd, xs16, out, o0) for an integer row dot, as _float_rows."""
    @numba.njit(nogil=True, fastmath=_FASTMATH)
    def rows(w, r0, r1, xq, xd, xs16, out, o0):
        ahead = rows_ahead(w)
        for r in range(r0, r1):
            prefetch_row(w, r, ahead)
            out[o0 + r - r0] = dot(w[r], xq, xd, xs16)
    return rows


_rows_idot_q4_k = _int_rows(idot_q4_k)
_rows_idot_q6_k = _int_rows(idot_q6_k)
_rows_idot_q5_k = _int_rows(idot_q5_k)
_rows_idot_q3_k = _int_rows(idot_q3_k)
_rows_idot_iq4_xs = _int_rows(idot_iq4_xs)
_rows_idot_iq4_nl = _int_rows(idot_iq4_nl)
_rows_idot_mxfp4 = _int_rows(idot_mxfp4)
_rows_idot_q4_0 = _int_rows(idot_q4_0)
_rows_idot_q4_1 = _int_rows(idot_q4_1)
_rows_idot_q5_0 = _int_rows(idot_q5_0)
_rows_idot_q5_1 = _int_rows(idot_q5_1)
_rows_idot_iq2_xs = _int_rows(idot_iq2_xs)
_rows_idot_iq2_xxs = _int_rows(idot_iq2_xxs)
_rows_idot_iq3_xxs = _int_rows(idot_iq3_xxs)
_rows_idot_iq2_s = _int_rows(idot_iq2_s)
_rows_idot_iq3_s = _int_rows(idot_iq3_s)
_rows_idot_iq1_s = _int_rows(idot_iq1_s)
_rows_idot_iq1_m = _int_rows(idot_iq1_m)
_rows_idot_q2_k = _int_rows(idot_q2_k)
_rows_idot_q2_0 = _int_rows(idot_q2_0)
_rows_idot_q8_0 = _int_rows(idot_q8_0)


@numba.njit(nogil=True, fastmath=_FASTMATH)
def _rows_idot_planes(w, r0, r1, xq, xd, xs16, out, o0):
    """_int_rows for IQ2_XS_PLANES: xq in the planes' value order already (int_ready)."""
    ahead = rows_ahead(w)
    for r in range(r0, r1):
        prefetch_row(w, r, ahead)
        out[o0 + r - r0] = idot_planes(w[r], xq, xd)


@numba.njit(inline="always", nogil=True)
def int_ready(t, xq):
    """int8 activation codes (a 1-D array of whole 256-value blocks for IQ2_XS_PLANES) as int_dots takes them
    for type t: in the planes' value order for IQ2_XS_PLANES (a new array, made once per input, not once per
    call of rows: a task of 16 rows of 512 values had spent as long ordering its input as computing), as they
    are for every other type."""
    if t == IQ2_XS_PLANES:
        return planes_order_i8(xq)
    return xq


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def int_dots(t, w, r0, r1, xq, xd, xs16, out, o0):
    """out[o0 + r - r0] = row r of w (a has_int_dot type) times quantized activations (xq codes as int_ready(t)
    gives them, xd block scales, xs16 the codes' 16-sums) for r0 <= r < r1, rows requested ahead as
    rows_ahead says; the type's branch taken once a call (see float_dots)."""
    if t == Q4_K:
        _rows_idot_q4_k(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == Q6_K:
        _rows_idot_q6_k(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == Q5_K:
        _rows_idot_q5_k(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == Q3_K:
        _rows_idot_q3_k(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == IQ4_XS:
        _rows_idot_iq4_xs(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == IQ4_NL:
        _rows_idot_iq4_nl(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == MXFP4:
        _rows_idot_mxfp4(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == Q4_0:
        _rows_idot_q4_0(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == Q4_1:
        _rows_idot_q4_1(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == Q5_0:
        _rows_idot_q5_0(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == Q5_1:
        _rows_idot_q5_1(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == IQ2_XS:
        _rows_idot_iq2_xs(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == IQ2_XS_PLANES:
        _rows_idot_planes(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == IQ2_XXS:
        _rows_idot_iq2_xxs(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == IQ3_XXS:
        _rows_idot_iq3_xxs(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == IQ2_S:
        _rows_idot_iq2_s(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == IQ3_S:
        _rows_idot_iq3_s(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == IQ1_S:
        _rows_idot_iq1_s(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == IQ1_M:
        _rows_idot_iq1_m(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == Q2_K:
        _rows_idot_q2_k(w, r0, r1, xq, xd, xs16, out, o0)
    elif t == Q2_0:
        _rows_idot_q2_0(w, r0, r1, xq, xd, xs16, out, o0)
    else:
        _rows_idot_q8_0(w, r0, r1, xq, xd, xs16, out, o0)


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _matvec_int_rows(t, w, xq, xd, xs16, out, workers):
    counter = task_counter()
    for worker in numba.prange(workers):  # runs of contiguous rows from the counter (task_queue)
        for r0, r1 in claimed_runs(counter, w.shape[0], workers, ROW_TASK):
            int_dots(t, w, r0, r1, xq, xd, xs16, out, r0)


# The integer matrix-vector products round their float activations themselves (ggml's blocks of `block` values,
# quant_int): one kernel call from Python per product instead of two, and no arrays made in Python. A decoded
# token's Python runs with cold caches (each product streams megabytes through them), where every Python step
# costs a few microseconds.
@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def matvec_int(t, w, x, block, out, workers):
    """out = W @ x for a has_int_dot type, x float32 rounded to int8 blocks as ggml does (quant_int), over
    `workers` worker threads (<= 0: the calling thread's Numba thread count)."""
    xq, xd, xs16 = q8_activations(x, block)
    _matvec_int_rows(t, w, int_ready(t, xq), xd, xs16, out, worker_count(workers))


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH)
def matvec_int_serial(t, w, x, block, out):
    """matvec_int on the calling thread (small matrices)."""
    xq, xd, xs16 = q8_activations(x, block)
    _matvec_int_rows(t, w, int_ready(t, xq), xd, xs16, out, 1)


# Several matrices on one input (a DeltaNet layer's q/k/v, gate and beta/alpha projections; an attention layer's
# q, k and v) as one parallel region over their rows stacked: each region costs its start and, at its end, the
# wait for the slowest claim, and its first reads come before the cores' streams are running. A tuple of matrices
# of one type and width; out holds their outputs one after another, the same bits as one matvec_int each. The
# 80B-shaped Q4_K file, int8, 2 threads (Zen 4), 4 alternating process pairs of 40 tokens: a token's mixer
# products (3 DeltaNet and 1 attention layer) took 1.60-1.69 ms against 1.65-1.76, reading at 0.91-0.95 of the
# output head's pace in the same tokens against 0.86-0.92.
@numba.njit(nogil=True, fastmath=False)  # integer arithmetic only
def _stacked_rows(ws):
    n = 0
    for w in ws:
        n += w.shape[0]
    return n


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def matvecs_int(t, ws, x, block, out, workers):
    """matvec_int of each matrix of the tuple ws (one type and width) with one x, in one parallel region."""
    xq, xd, xs16 = q8_activations(x, block)
    xq = int_ready(t, xq)
    workers = worker_count(workers)
    n = _stacked_rows(ws)
    counter = task_counter()
    for worker in numba.prange(workers):
        for r0, r1 in claimed_runs(counter, n, workers, ROW_TASK):
            first = 0
            for w in ws:  # the claim's rows in each matrix it crosses
                a, b = max(r0, first), min(r1, first + w.shape[0])
                if a < b:
                    int_dots(t, w, a - first, b - first, xq, xd, xs16, out, a)
                first += w.shape[0]


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def matvecs(t, ws, x, out, workers):
    """matvec of each matrix of the tuple ws (one type and width) with one x, in one parallel region."""
    workers = worker_count(workers)
    xsum32 = np.empty(max(1, x.shape[0] // 32), np.float32)
    if x.shape[0] % 32 == 0:
        block_sums32(x, xsum32)
    fused = has_fused_dot(t)
    xr = float_ready(t, x)
    n = _stacked_rows(ws)
    counter = task_counter()
    for worker in numba.prange(workers):
        scratch = xsum32 if fused else np.empty(x.shape[0], np.float32)
        for r0, r1 in claimed_runs(counter, n, workers, ROW_TASK):
            first = 0
            for w in ws:
                a, b = max(r0, first), min(r1, first + w.shape[0])
                if a < b:
                    float_dots(t, w, a - first, b - first, xr, xsum32, scratch, out, a)
                first += w.shape[0]
