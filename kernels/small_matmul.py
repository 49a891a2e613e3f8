"""Small float32 matrix products for use inside other Numba kernels (a chunk of DeltaNet tokens,
a block of attention keys): operands of a few dozen to a few hundred rows that live in cache,
where calling out to BLAS per block is not possible from nopython code."""

import numba
import numpy as np

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
