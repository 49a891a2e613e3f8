"""Architecture registry: one module per GGUF ``general.architecture``.

Each module defines ``ARCH`` (the GGUF name) and ``Model(weights, device)`` with ``config``,
``new_state(max_context)``, ``forward(state, tokens, hook)`` (final-normed hidden states, advancing the
state), ``logits(hidden)`` and, where it holds resources beyond the file mapping, ``close()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from ..config import LoadOptions, ModelConfig
from ..device import Device
from ..state import SequenceState
from ..weights import WeightStore

# Called with each named intermediate tensor (name, layer index or -1, tensor); returns the tensor.
DebugHook = Callable[[str, int, np.ndarray], np.ndarray]


def no_hook(name: str, layer: int, tensor: np.ndarray) -> np.ndarray:
    """The hook of a runtime without a debug hook: an architecture given this one may fuse the steps whose
    intermediate tensors no one watches (a decoded layer in one compiled call)."""
    return tensor


class ArchModel(Protocol):
    config: ModelConfig

    def __init__(self, ws: WeightStore, dev: Device, options: LoadOptions | None = None) -> None: ...

    def new_state(self, max_context: int) -> SequenceState: ...

    def forward(self, state: SequenceState, tokens: np.ndarray, hook: DebugHook) -> np.ndarray: ...

    def logits(self, h: np.ndarray) -> np.ndarray: ...


from . import qwen3moe, qwen3next, qwen4exp  # noqa: E402  (they import DebugHook from here)

ARCHITECTURES: dict[str, type[ArchModel]] = {m.ARCH: m.Model for m in (qwen3moe, qwen3next, qwen4exp)}


class UnsupportedArchitectureError(ValueError):
    pass


def model_class(arch: str) -> type[ArchModel]:
    """The model class of a GGUF architecture name; a clear error for one that is not supported."""
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model architecture '{arch}' (GGUF general.architecture) is not supported; supported: "
            + ", ".join(sorted(ARCHITECTURES))) from None
