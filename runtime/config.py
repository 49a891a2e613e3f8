"""Model hyperparameters read from GGUF metadata.

``ModelConfig`` holds what every supported architecture has (sizes, attention shape, RoPE, experts);
each architecture file subclasses it with its own fields and reads them in ``arch_fields``. Keys are
the ones llama.cpp's converter writes (``{arch}.block_count``, ``{arch}.attention.head_count`` ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strata_async.io import GGUFFile

_REQUIRED = object()


class Metadata:
    """Typed access to a GGUF file's metadata, with ``{arch}.`` prefixed keys and clear errors."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self.arch = str(gguf.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """Value of ``{arch}.{key}``; raises ValueError naming the key if it is absent and has no default."""
        full = f"{self.arch}.{key}"
        if full in self.gguf.metadata:
            return self.gguf.metadata[full]
        if default is _REQUIRED:
            raise ValueError(f"{self.gguf.path}: GGUF metadata key '{full}' is missing; the file is incomplete "
                             f"or was not converted as a {self.arch} model")
        return default

    def get_int(self, key: str, default: Any = _REQUIRED) -> int:
        return int(self.get(key, default))

    def get_float(self, key: str, default: Any = _REQUIRED) -> float:
        return float(self.get(key, default))

    def decoder_layers(self) -> int:
        """Blocks run per token: block_count includes the multi-token-prediction blocks appended after them."""
        return self.get_int("block_count") - self.get_int("nextn_predict_layers", 0)

    def tensor_rows(self, name: str) -> int:
        """Rows (first numpy dimension) of a tensor, e.g. the vocabulary size of the output head."""
        info = self.gguf.tensors.get(name)
        if info is None:
            raise ValueError(f"{self.gguf.path}: tensor '{name}' is missing")
        return int(info.shape[0])


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int  # decoder blocks run per token (excludes multi-token-prediction blocks)
    hidden: int
    vocab_size: int  # rows of the output head, i.e. the width of a logits row
    context_length: int  # positions the model was trained for
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_dim: int  # leading dimensions of each head that RoPE rotates (NEOX halves); the rest pass through
    n_experts: int
    n_experts_used: int
    expert_ffn: int  # intermediate size of one routed expert

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelConfig:
        md = Metadata(gguf)
        return cls(**cls.common_fields(md), **cls.arch_fields(md))

    @classmethod
    def common_fields(cls, md: Metadata) -> dict[str, Any]:
        scaling = md.get("rope.scaling.type", "none")
        if scaling not in ("none", "", None):
            raise ValueError(f"{md.gguf.path}: RoPE scaling '{scaling}' ({md.arch}.rope.scaling.type) is not "
                             f"supported; use a file converted without rope scaling")
        n_heads = md.get_int("attention.head_count")
        hidden = md.get_int("embedding_length")
        head_dim = md.get_int("attention.key_length", hidden // n_heads)
        head = "output.weight" if "output.weight" in md.gguf.tensors else "token_embd.weight"
        return dict(
            arch=md.arch,
            n_layers=md.decoder_layers(),
            hidden=hidden,
            vocab_size=md.tensor_rows(head),
            context_length=md.get_int("context_length"),
            n_heads=n_heads,
            n_kv_heads=md.get_int("attention.head_count_kv", n_heads),
            head_dim=head_dim,
            rms_eps=md.get_float("attention.layer_norm_rms_epsilon"),
            rope_theta=md.get_float("rope.freq_base", 10000.0),
            rope_dim=md.get_int("rope.dimension_count", head_dim),
            n_experts=md.get_int("expert_count"),
            n_experts_used=md.get_int("expert_used_count"),
            expert_ffn=md.get_int("expert_feed_forward_length"),
        )

    @classmethod
    def arch_fields(cls, md: Metadata) -> dict[str, Any]:
        """Fields an architecture adds to the common ones; subclasses override."""
        return {}


@dataclass(frozen=True)
class LoadOptions:
    """How a model's tiers are served, beyond the device: options an architecture may use or ignore."""

    ple_io: str = "direct"  # n-gram PLE table: "direct" (O_DIRECT reads), "mmap" or "ram" (read whole at load)
    ple_cache_rows: int = 4096  # PLE rows kept in RAM after use (LRU); prefetched rows wait there too
    prefault: bool = True  # fault every weight page the model computes from into the mapping at load
    progress: Callable[[int, int], None] | None = None  # progress(done, total bytes) while repacking, prefaulting
    repack: str = "auto"  # IQ2_XS matrices as IQ2_XS_PLANES: "auto", "always" or "never" (runtime/weights.py)
    # the other matrices copied at load onto transparent huge pages: "auto", "always" or "never" (runtime/weights.py)
    huge_pages: str = "auto"
    # keep the working buffers that steps free mapped for the next step (glibc's malloc: runtime/host_memory.py)
    keep_freed_buffers: bool = True
