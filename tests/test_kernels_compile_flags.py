"""Kernels keep their own floating-point rules whichever caller compiles them first.

Numba compiles a callee the first time a caller needs it, and a callee whose decorator does not state
`fastmath` inherits the caller's: a fast-math caller may then turn the quantizer's x * (1/d) into x / d, and
the disk cache keeps that variant for every later caller. So every kernel that is not inlined states its
flags, and the exact ones (rounding, decoding) say fastmath=False.
"""

import importlib
import pkgutil

import gguf
import numba
import numpy as np
from gguf import quants as gguf_quants
from numba.core.registry import CPUDispatcher

import strata_async.kernels as kernels
from strata_async.kernels import quant_int

_FAST = {"nsz", "arcp", "contract", "reassoc"}


def _kernel_dispatchers():
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == module.__name__:
                yield f"{info.name}.{name}", obj


def test_every_compiled_kernel_states_fastmath():
    found = dict(_kernel_dispatchers())
    assert "quant_int.quantize_q8" in found and len(found) > 50
    missing = [name for name, d in found.items()
               if d.targetoptions.get("inline") != "always" and "fastmath" not in d.targetoptions]
    assert not missing, f"kernels that would inherit a caller's fastmath: {missing}"


def test_q8_0_rounding_tie_under_a_fast_math_caller():
    # x * (1/d) is exactly 107.5 in float32 (roundf: 108) while x / d is 107.4957 (107); gguf-py rounds the former
    block = np.zeros((1, 32), np.float32)
    block[0, 0] = np.uint32(1095037184).view(np.float32)   # 12.308838, the block's largest magnitude
    block[0, 20] = np.uint32(1093055438).view(np.float32)  # 10.418898
    want = gguf_quants.quantize(block, gguf.GGMLQuantizationType.Q8_0)
    want_codes = want[0, 2:].view(np.int8)
    assert want_codes[20] == 108

    # a fresh copy of the quantizer with its own decorator options, first compiled by a fast-math caller
    options = {k: v for k, v in quant_int.quantize_q8.targetoptions.items() if k not in ("cache", "nopython")}
    quantize = numba.njit(**options)(quant_int.quantize_q8.py_func)

    @numba.njit(fastmath=_FAST)
    def caller(x, xq, xd):
        quantize(x, 32, xq, xd)

    xq = np.empty(32, np.int8)
    xd = np.empty(1, np.float32)
    caller(block[0], xq, xd)
    np.testing.assert_array_equal(xq, want_codes)
    assert np.float16(xd[0]).tobytes() == want[0, :2].tobytes()
