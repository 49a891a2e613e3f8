"""Unquantized ggml storage types: F32, F16 and BF16 rows."""

import numba
import numpy as np

from .ggml_blocks import f16
from .quant import register_type

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


register_type(F32, "F32", 1, 4, act_block=0)
register_type(F16, "F16", 1, 2, act_block=0)
register_type(BF16, "BF16", 1, 2, act_block=0)
