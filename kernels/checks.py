"""Argument checks shared by the kernel wrappers: Numba kernels trust their inputs, so every
public wrapper validates shapes, dtypes and memory layout here before calling one."""

from __future__ import annotations

import numpy as np


def require_array(name: str, a: object, shape: tuple[int | None, ...], dtype: type = np.float32,
                  writable: bool = False) -> np.ndarray:
    """Check that ``a`` is a C-contiguous ndarray of ``dtype`` whose shape matches ``shape``
    (``None`` entries match any size) and return it; raise ValueError naming what is wrong."""
    if (isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == len(shape) and a.flags.c_contiguous
            and (a.flags.writeable or not writable)
            and all(s is None or s == got for s, got in zip(shape, a.shape))):
        return a  # the common case, checked before any message is built (kernels check every call)
    expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy array of shape {expected}, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name} must have dtype {np.dtype(dtype).name}, got {a.dtype.name}; "
                         f"convert it with .astype(np.{np.dtype(dtype).name})")
    if a.ndim != len(shape) or any(s is not None and s != got for s, got in zip(shape, a.shape)):
        raise ValueError(f"{name} must have shape {expected}, got {list(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous; pass np.ascontiguousarray({name})")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} is updated in place and must be writable")
    return a


def require_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
