"""Unquantized ggml storage types: F32, F16 and BF16 rows."""

import numba
import numpy as np

from .ggml_blocks import f16, u16
from .quant import register_type
from .simd import HAS_F16C, f32_from_bits, fdot_bf16_64, fdot_f16_64

F32, F16, BF16 = 0, 1, 30


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_f32(src, dst):
    dst[:] = src.view(np.float32)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_f16(src, dst):
    for i in range(dst.shape[0]):
        dst[i] = f16(src, 2 * i)


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_bf16(src, dst):
    # bf16 is the high half of an fp32: shift it into place.
    b = src.view(np.uint16)
    bits = dst.view(np.uint32)
    for i in range(dst.shape[0]):
        bits[i] = np.uint32(b[i]) << 16


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def dot_f16(src, x, xsum32):
    """One F16 row times float32 x: 64 values a step converted in vector lanes (simd.fdot_f16_64, F16C), the rest
    one by one."""
    acc = np.float32(0.0)
    first = 0
    if HAS_F16C:
        first = x.shape[0] // 64 * 64
        acc = fdot_f16_64(src, x, first // 64)
    for i in range(first, x.shape[0]):
        acc += f16(src, 2 * i) * x[i]
    return acc


@numba.njit(inline="always", nogil=True, fastmath={"nsz", "arcp", "contract", "reassoc"})
def dot_bf16(src, x, xsum32):
    """One BF16 row times float32 x: 64 values a step (simd.fdot_bf16_64), the rest one by one."""
    first = x.shape[0] // 64 * 64
    acc = fdot_bf16_64(src, x, first // 64)
    for i in range(first, x.shape[0]):
        acc += f32_from_bits(np.uint32(u16(src, 2 * i)) << np.uint32(16)) * x[i]
    return acc


register_type(F32, "F32", 1, 4, act_block=0)
register_type(F16, "F16", 1, 2, act_block=0)
register_type(BF16, "BF16", 1, 2, act_block=0)
