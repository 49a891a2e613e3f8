"""Compute kernels: Numba CPU kernels with float64 references (and, later, CUDA sources)."""
