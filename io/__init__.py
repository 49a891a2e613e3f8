"""GGUF files: reading (memory-mapped), writing, and the ggml tensor type table."""

from .ggml_types import GGUFError
from .gguf_reader import GGUFFile, TensorInfo, open_gguf, prefault, release
from .gguf_writer import write_gguf, write_gguf_split

__all__ = ["GGUFError", "GGUFFile", "TensorInfo", "open_gguf", "prefault", "release", "write_gguf", "write_gguf_split"]

# Unbuffered reads and the on-disk Per-Layer-Embedding rows built on them.
from .direct_reader import DirectReader, ReadError  # noqa: E402
from .ple_rows import PLERowSource, PLEStats  # noqa: E402

__all__ += ["DirectReader", "ReadError", "PLERowSource", "PLEStats"]
