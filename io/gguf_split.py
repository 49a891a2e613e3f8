"""How a model split over several GGUF files (llama.cpp's gguf-split convention) names its shards.

Shard k (0-based) of n is "<prefix>-<k+1:05d>-of-<n:05d>.gguf". Every shard carries split.no (u16, its 0-based
index), split.count (u16, n) and split.tensors.count (i32, the tensors of all shards together); only the first
shard carries the rest of the metadata.
"""

from __future__ import annotations

from pathlib import Path

from gguf.constants import Keys

SPLIT_NO = Keys.Split.LLM_KV_SPLIT_NO
SPLIT_COUNT = Keys.Split.LLM_KV_SPLIT_COUNT
SPLIT_TENSORS_COUNT = Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT)


def shard_suffix(index: int, count: int) -> str:
    """"-00002-of-00004.gguf" for index 1 (0-based) of 4."""
    return f"-{index + 1:05d}-of-{count:05d}.gguf"


def shard_path(prefix: str | Path, index: int, count: int) -> Path:
    """Path of shard `index` (0-based) of `count` for a prefix such as "models/qwen3"."""
    return Path(f"{prefix}{shard_suffix(index, count)}")


def shard_prefix(path: str | Path, index: int, count: int) -> str | None:
    """The prefix a shard's path was built from, or None when the name does not follow the convention."""
    text = str(path)
    suffix = shard_suffix(index, count)
    if len(text) > len(suffix) and text.endswith(suffix):
        return text[: -len(suffix)]
    return None
