"""Small float32 matrix products for use inside other Numba kernels (a chunk of DeltaNet tokens,
a block of attention keys): operands of a few dozen to a few hundred rows that live in cache,
where calling out to BLAS per block is not possible from nopython code."""

import numba
import numpy as np

from .simd import (fdot_nt_1x1, fdot_nt_1x4, fdot_nt_2x1, fdot_nt_2x4, fdot_nt_3x1, fdot_nt_3x4, fdot_nt_4x1,
                   fdot_nt_4x4, fmadd_nn_1x1, fmadd_nn_1x4, fmadd_nn_4x1, fmadd_nn_4x4)

# Reassociation lets LLVM vectorize dot products; the no-NaN/no-inf assumptions stay off so that
# exp underflow, -inf masks and SiLU of large negatives behave exactly as in IEEE arithmetic.
FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def matmul_nt(a, b, c, m, n, k, accumulate):
    """c[:m, :n] = a[:m, :k] @ b[:n, :k].T (added to c when accumulate). Dot products over
    contiguous rows, 2 x 4 outputs at a time, so each loaded value feeds several FMAs."""
    m2 = m - m % 2
    n4 = n - n % 4
    for t in range(0, m2, 2):
        for j in range(0, n4, 4):
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0.0)
            for i in range(k):
                a0 = a[t, i]
                a1 = a[t + 1, i]
                b0 = b[j, i]
                b1 = b[j + 1, i]
                b2 = b[j + 2, i]
                b3 = b[j + 3, i]
                s00 += a0 * b0
                s01 += a0 * b1
                s02 += a0 * b2
                s03 += a0 * b3
                s10 += a1 * b0
                s11 += a1 * b1
                s12 += a1 * b2
                s13 += a1 * b3
            if not accumulate:
                c[t, j] = c[t, j + 1] = c[t, j + 2] = c[t, j + 3] = np.float32(0.0)
                c[t + 1, j] = c[t + 1, j + 1] = c[t + 1, j + 2] = c[t + 1, j + 3] = np.float32(0.0)
            c[t, j] += s00
            c[t, j + 1] += s01
            c[t, j + 2] += s02
            c[t, j + 3] += s03
            c[t + 1, j] += s10
            c[t + 1, j + 1] += s11
            c[t + 1, j + 2] += s12
            c[t + 1, j + 3] += s13
        for j in range(n4, n):
            s0 = s1 = np.float32(0.0)
            for i in range(k):
                s0 += a[t, i] * b[j, i]
                s1 += a[t + 1, i] * b[j, i]
            if not accumulate:
                c[t, j] = c[t + 1, j] = np.float32(0.0)
            c[t, j] += s0
            c[t + 1, j] += s1
    for t in range(m2, m):
        for j in range(n):
            s0 = np.float32(0.0)
            for i in range(k):
                s0 += a[t, i] * b[j, i]
            if not accumulate:
                c[t, j] = np.float32(0.0)
            c[t, j] += s0


# Length of the k-chunks matmul_nt_regs works through: 4 rows of B and all of A's rows over 512 values
# (2 KB each) stay in the 48 KB L1 cache while every block of A's rows passes over them.
_KC = 512


@numba.njit(inline="always", nogil=True)
def _fdot_nt(mr, nr, a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate):
    """The simd.fdot_nt_<mr>x<nr> block for mr in 1..4, nr in (1, 4)."""
    if nr == 4:
        if mr == 4:
            fdot_nt_4x4(a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate)
        elif mr == 3:
            fdot_nt_3x4(a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate)
        elif mr == 2:
            fdot_nt_2x4(a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate)
        else:
            fdot_nt_1x4(a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate)
    elif mr == 4:
        fdot_nt_4x1(a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate)
    elif mr == 3:
        fdot_nt_3x1(a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate)
    elif mr == 2:
        fdot_nt_2x1(a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate)
    else:
        fdot_nt_1x1(a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate)


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def matmul_nt_at(a, ao, lda, b, bo, ldb, c, co, ldc, m, n, k, accumulate):
    """C = A B^T on C-contiguous arrays addressed by flat element offsets and row strides: c[co + t ldc + j]
    (+)= sum_{i < k} a[ao + t lda + i] b[bo + j ldb + i] for t < m, j < n. Register-blocked 4 x 4 dot products
    over 16-lane vectors (simd.fdot_nt_*), the edges in narrower blocks, the last k % 16 terms in a scalar loop.
    Meant for operands in cache: callers chunk long k (matmul_nt_regs)."""
    k16 = k // 16
    j = 0
    while j < n:  # B's rows 4 at a time (they stay in L1 while A's rows pass over them), then one at a time
        nr = 4 if n - j >= 4 else 1
        for t in range(0, m, 4):
            _fdot_nt(min(4, m - t), nr, a, ao + t * lda, lda, b, bo + j * ldb, ldb, k16, c, co + t * ldc + j, ldc,
                     accumulate)
        j += nr
    if 16 * k16 < k:
        af, bf, cf = a.reshape(-1), b.reshape(-1), c.reshape(-1)
        for t in range(m):
            for j in range(n):
                s = np.float32(0.0)
                for i in range(16 * k16, k):
                    s += af[ao + t * lda + i] * bf[bo + j * ldb + i]
                if k16 == 0 and not accumulate:
                    cf[co + t * ldc + j] = s
                else:
                    cf[co + t * ldc + j] += s


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def matmul_nt_regs(a, b, c, m, n, k, accumulate):
    """matmul_nt for C-contiguous operands: matmul_nt_at over k in chunks of _KC."""
    if k == 0:
        if not accumulate:
            c[:m, :n] = np.float32(0.0)
        return
    for kc in range(0, k, _KC):
        matmul_nt_at(a, kc, a.shape[1], b, kc, b.shape[1], c, 0, c.shape[1], m, n, min(_KC, k - kc),
                     accumulate or kc > 0)


@numba.njit(inline="always", nogil=True)
def _fmadd_nn(mr, nv, a, ao, lda, b, bo, ldb, k, c, co, ldc, accumulate):
    """The simd.fmadd_nn_<mr>x<nv> block for mr in (1, 4), nv in (1, 4)."""
    if mr == 4:
        if nv == 4:
            fmadd_nn_4x4(a, ao, lda, b, bo, ldb, k, c, co, ldc, accumulate)
        else:
            fmadd_nn_4x1(a, ao, lda, b, bo, ldb, k, c, co, ldc, accumulate)
    elif nv == 4:
        fmadd_nn_1x4(a, ao, lda, b, bo, ldb, k, c, co, ldc, accumulate)
    else:
        fmadd_nn_1x1(a, ao, lda, b, bo, ldb, k, c, co, ldc, accumulate)


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def matmul_nn_at(a, ao, lda, b, bo, ldb, c, co, ldc, m, n, k, accumulate):
    """C = A B on C-contiguous arrays addressed by flat element offsets and row strides: c[co + t ldc + j] (+)=
    sum_{p < k} a[ao + t lda + p] b[bo + p ldb + j] for t < m, j < n. Outer products in register blocks of 4 rows
    x 64 columns (simd.fmadd_nn_*: a broadcast value of A times rows of B, no horizontal sums), a panel of 64
    columns of B at a time (k = 128: 32 KB, in cache while A's rows pass over it); the edges in blocks of 1 row
    and 16 columns, the last n % 16 columns in a scalar loop."""
    n16 = n - n % 16
    j = 0
    while j < n16:
        nv = 4 if n16 - j >= 64 else 1
        t = 0
        while t < m:
            mr = 4 if m - t >= 4 else 1
            _fmadd_nn(mr, nv, a, ao + t * lda, lda, b, bo + j, ldb, k, c, co + t * ldc + j, ldc, accumulate)
            t += mr
        j += 16 * nv
    if n16 < n:
        af, bf, cf = a.reshape(-1), b.reshape(-1), c.reshape(-1)
        for t in range(m):
            for jj in range(n16, n):
                s = np.float32(0.0)
                for p in range(k):
                    s += af[ao + t * lda + p] * bf[bo + p * ldb + jj]
                at = co + t * ldc + jj
                cf[at] = cf[at] + s if accumulate else s


@numba.njit(nogil=True, cache=True, fastmath=FASTMATH)
def matmul_nn(a, b, c, m, n, k, accumulate):
    """c[:m, :n] = a[:m, :k] @ b[:k, :n] (added to c when accumulate), on C-contiguous 2-D operands (matmul_nn_at)."""
    matmul_nn_at(a, 0, a.shape[1], b, 0, b.shape[1], c, 0, c.shape[1], m, n, k, accumulate)
