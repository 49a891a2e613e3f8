"""Model execution: GGUF weights, architectures, shared layers, MoE dispatch, per-sequence state."""

from .config import LoadOptions, ModelConfig
from .loader import Runtime, load_runtime

__all__ = ["LoadOptions", "ModelConfig", "Runtime", "load_runtime"]
