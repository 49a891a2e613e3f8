"""GGUF files: reading (memory-mapped), writing, and the ggml tensor type table."""

from .ggml_types import GGUFError
from .gguf_reader import GGUFFile, TensorInfo, open_gguf
from .gguf_writer import write_gguf, write_gguf_split

__all__ = ["GGUFError", "GGUFFile", "TensorInfo", "open_gguf", "write_gguf", "write_gguf_split"]
