"""Q8_0: blocks of 32 int8 weights with one fp16 scale."""

import numba

from .ggml_blocks import f16
from .quant import register_type
from .simd import dequant_s8_32

Q8_0 = 8
_QK = 32
_BLOCK_BYTES = 34


@numba.njit(nogil=True, cache=True, fastmath=False)
def dequant_q8_0(src, dst):
    for b in range(dst.shape[0] // _QK):
        o = b * _BLOCK_BYTES
        dequant_s8_32(src, o + 2, f16(src, o), dst, b * _QK)


register_type(Q8_0, "Q8_0", _QK, _BLOCK_BYTES, act_block=32)
