"""What `strata-async inspect` reports about a GGUF model: architecture, sizes, parameters, tensor types and
the placement table (which part of the model goes to which tier, and whether it fits a VRAM budget)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .io import GGUFFile
from .io.ggml_types import type_name
from .runtime.archs import model_class
from .runtime.config import ModelConfig
from .runtime.placement import EMBEDDINGS, MTP_LAYER, NGRAM_TABLE, NGRAM_TIERS, ROUTED_EXPERTS, PlacementTable
from .runtime.placement import decoder_layers
from .runtime.placement import placement_table, tensor_part
from .kernels import quant_planes
from .runtime.weights import held_bytes, physical_memory, repacked_bytes, repacks_iq2_xs

__all__ = ["ModelInfo", "NGramTableInfo", "RepackInfo", "TypeCount", "describe", "format_bytes", "format_count"]

RANDOM_WEIGHTS_MARK = "random weights"  # the default model's general.name carries it


@dataclass(frozen=True)
class TypeCount:
    ggml_type: str
    n_tensors: int
    nbytes: int


@dataclass(frozen=True)
class ModelInfo:
    path: str
    name: str
    random_weights: bool  # the embedded default model (or any file named as random weights)
    file_bytes: int
    config: ModelConfig
    n_mtp_layers: int
    total_params: int
    active_params: int  # per token: everything but the routed experts not chosen, the MTP layer and the n-gram table
    tensor_types: list[TypeCount] = field(default_factory=list)  # largest first
    placement: PlacementTable | None = None
    ngram_table: NGramTableInfo | None = None  # qwen4exp's PLE table, when the file has one
    repack: RepackInfo | None = None  # when the file has IQ2_XS matrices, which load can repack


@dataclass(frozen=True)
class NGramTableInfo:
    nbytes: int
    rows: int
    row_bytes: int
    ggml_type: str
    tier: str  # where the engine reads it from with the chosen --ple-io
    layer: int | None  # the decoder layer that uses it


@dataclass(frozen=True)
class RepackInfo:
    """What the CPU engine holds of a file with IQ2_XS matrices (runtime/weights.py: repacked at load into
    IQ2_XS_PLANES, 1.43x the bytes, where the CPU has AVX-512 VBMI and --repack says so)."""
    iq2_xs_bytes: int  # the file's IQ2_XS bytes that a repack turns into planes
    held_bytes: int  # the model's bytes as the CPU engine holds them repacked
    file_tensor_bytes: int  # ... and as they lie
    auto: bool  # whether --repack auto (the default) repacks on this machine
    cpu_can: bool  # whether this CPU runs the repacked dots (AVX-512 VBMI); auto's other reason is the RAM
    ram_bytes: int  # this machine's RAM, which auto's rule reads


def _repack(gguf: GGUFFile) -> RepackInfo | None:
    iq2_xs = repacked_bytes(gguf)
    if not iq2_xs:
        return None
    return RepackInfo(iq2_xs, held_bytes(gguf, True), held_bytes(gguf, False), repacks_iq2_xs(gguf, "auto"),
                      quant_planes.AVAILABLE, physical_memory())


def _ngram_table(gguf: GGUFFile, ple_io: str) -> NGramTableInfo | None:
    info = gguf.tensors.get("per_layer_token_embd.weight")
    if info is None:
        return None
    arch = gguf.metadata.get("general.architecture")
    layers = list(gguf.metadata.get(f"{arch}.ple.layers", []))
    return NGramTableInfo(nbytes=int(info.data.nbytes), rows=info.n_rows, row_bytes=info.row_bytes,
                          ggml_type=type_name(info.ggml_type), tier=NGRAM_TIERS[ple_io],
                          layer=int(layers[0]) if layers else None)


def describe(gguf: GGUFFile, vram_bytes: int | None = None, ple_io: str = "direct") -> ModelInfo:
    """Summarise an opened GGUF model; raises UnsupportedArchitectureError for an architecture we cannot run.
    ple_io: the n-gram table's read mode, which decides its tier in the placement table."""
    arch = gguf.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{gguf.path}: GGUF metadata has no general.architecture; not a model file")
    model_class(arch)  # refuse architectures the runtime does not know, with its message
    config = ModelConfig.from_gguf(gguf)
    n_layers = decoder_layers(gguf)
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    total = active = 0
    for name, info in gguf.tensors.items():
        t = type_name(info.ggml_type)
        counts[t] += 1
        sizes[t] += int(info.data.nbytes)
        total += info.n_elements
        part = tensor_part(name, n_layers)
        if part == ROUTED_EXPERTS:
            active += info.n_elements * config.n_experts_used // max(config.n_experts, 1)
        elif part == EMBEDDINGS:
            active += info.n_elements // max(config.vocab_size, 1)  # one row per token
        elif part not in (MTP_LAYER, NGRAM_TABLE):
            active += info.n_elements
    types = [TypeCount(t, counts[t], sizes[t]) for t in sorted(sizes, key=lambda t: -sizes[t])]
    name = str(gguf.metadata.get("general.name") or gguf.path.name)
    file_bytes = sum(p.stat().st_size for p in gguf.shard_paths or [gguf.path])
    return ModelInfo(
        path=str(gguf.path),
        name=name,
        random_weights=RANDOM_WEIGHTS_MARK in name,
        file_bytes=file_bytes,
        config=config,
        n_mtp_layers=int(gguf.metadata.get(f"{arch}.nextn_predict_layers", 0)),
        total_params=total,
        active_params=active,
        tensor_types=types,
        placement=placement_table(gguf, vram_bytes, ple_io),
        ngram_table=_ngram_table(gguf, ple_io),
        repack=_repack(gguf),
    )


def format_bytes(n: int) -> str:
    """Binary units, as memory is sold: 1.5 GiB, 20.0 MiB, 512 B."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_count(n: int) -> str:
    """Parameter counts: 80.0B, 3.0M, 12.3K."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
