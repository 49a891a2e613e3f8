"""Model execution: GGUF weights, architectures, shared layers, MoE dispatch, per-sequence state."""

from .config import LoadOptions, ModelConfig
from .loader import PREFILL_CHUNK, Runtime, load_runtime

__all__ = ["PREFILL_CHUNK", "LoadOptions", "ModelConfig", "Runtime", "load_runtime"]
