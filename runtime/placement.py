"""Placement: which part of a model each tensor belongs to, how many bytes each part takes, and which tier
of the machine holds it.

Every tensor of a GGUF file falls into one part:

| part | tensors | read per token |
|---|---|---|
| dense | each layer's mixer or attention (`attn_*`, `ssm_*`, hyper-connections `hc_*`, the n-gram projections `ple_*`, `indexer.*`), norms, dense FFNs, anything not named below | all of it |
| routers | `ffn_gate_inp`, `ffn_gate_inp_shexp` | all of it |
| shared experts | `ffn_{gate,up,down}_shexp` | all of it |
| routed experts | `ffn_{gate,up,down,gate_up}_exps` | the selected experts only |
| embeddings | `token_embd` | one row |
| output head | `output`, `output_norm`, `output_hc_*` | all of it |
| MTP layer | blocks past the decoder stack (`blk.N`, N >= block_count - nextn_predict_layers), `nextn.*`, `mtp.*` | all of it (when speculating) |
| n-gram table | `per_layer_token_embd` (+ any `ngram*` tensor) | a few rows |

The n-gram table is qwen4exp's Per-Layer-Embedding table: gguf-py names it `per_layer_token_embd`
(MODEL_TENSOR.PER_LAYER_TOKEN_EMBD) and llama.cpp's qwen4exp loader reads it lazily, a few rows per token.
The small per-layer `blk.N.ple_*` projections that consume those rows are dense weights. Names containing
"ngram" are included too, a guess at how other n-gram-embedding files may spell their table.

Two plans are given for each part: the CPU-only engine (everything in host RAM, the n-gram table read from
NVMe with O_DIRECT, or as --ple-io says), and the GPU plan: VRAM for everything every token touches, routed
experts in pinned host RAM with a VRAM cache of the hottest ones filling whatever budget is left, embeddings in host RAM (a
token reads one row, not worth VRAM), the n-gram table on NVMe. That table answers "will it fit on my PC?".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from strata_async.io import GGUFFile

__all__ = ["PARTS", "PlacementRow", "PlacementTable", "decoder_layers", "placement_table", "tensor_part"]

DENSE = "dense"
ROUTERS = "routers"
SHARED_EXPERTS = "shared experts"
ROUTED_EXPERTS = "routed experts"
EMBEDDINGS = "embeddings"
OUTPUT_HEAD = "output head"
MTP_LAYER = "MTP layer"
NGRAM_TABLE = "n-gram table"
PARTS = (DENSE, ROUTERS, SHARED_EXPERTS, ROUTED_EXPERTS, EMBEDDINGS, OUTPUT_HEAD, MTP_LAYER, NGRAM_TABLE)

HOST_RAM = "host RAM"
PINNED_HOST_RAM = "pinned host RAM"
VRAM = "VRAM"
NVME = "NVMe (O_DIRECT)"
PAGE_CACHE = "NVMe (mmap)"  # read through the page cache, which keeps what was touched
# The n-gram table's tier for each of the engine's --ple-io modes.
NGRAM_TIERS = {"direct": NVME, "mmap": PAGE_CACHE, "ram": HOST_RAM}

# Tier of each part on the CPU-only engine and in the GPU plan.
CPU_TIERS = {part: HOST_RAM for part in PARTS} | {NGRAM_TABLE: NVME}
GPU_TIERS = {part: VRAM for part in PARTS} | {
    ROUTED_EXPERTS: PINNED_HOST_RAM,  # plus a VRAM cache of the hottest experts, sized from the budget left
    EMBEDDINGS: HOST_RAM,
    NGRAM_TABLE: NVME,
}

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def tensor_part(name: str, n_decoder_layers: int | None = None) -> str:
    """The part (one of PARTS) a tensor belongs to, from its GGUF name.

    n_decoder_layers: blocks run per token; `blk.N` tensors with N at or past it belong to the MTP layer.
    None means the file has no MTP blocks.
    """
    if name.startswith("per_layer_token_embd") or "ngram" in name:
        return NGRAM_TABLE
    if name.startswith("token_embd"):
        return EMBEDDINGS
    if name.startswith(("output.", "output_norm", "output_hc_")):
        return OUTPUT_HEAD
    if name.startswith(("mtp.", "nextn.")) or ".nextn." in name:
        return MTP_LAYER
    block = _BLOCK.match(name)
    if block is None:
        return DENSE
    if n_decoder_layers is not None and int(block.group(1)) >= n_decoder_layers:
        return MTP_LAYER
    tensor = block.group(2)
    if tensor.startswith("ffn_gate_inp"):
        return ROUTERS
    if "_shexp" in tensor:
        return SHARED_EXPERTS
    if "_exps" in tensor:
        return ROUTED_EXPERTS
    return DENSE


@dataclass(frozen=True)
class PlacementRow:
    part: str
    n_tensors: int
    nbytes: int
    cpu_tier: str  # where the CPU-only engine keeps it
    gpu_tier: str  # where the GPU plan keeps it


@dataclass(frozen=True)
class PlacementTable:
    rows: list[PlacementRow]  # one per part present in the file, in PARTS order
    total_bytes: int
    vram_budget: int | None  # the budget the GPU plan was made for (None: no budget given)
    vram_required: int  # bytes of the parts the GPU plan puts in VRAM (KV cache and activations not included)
    expert_cache_bytes: int  # routed-expert bytes that fit in the VRAM left over (0 without a budget)
    routed_expert_bytes: int

    @property
    def fits_vram(self) -> bool | None:
        """Whether the always-in-VRAM parts fit the budget; None without a budget."""
        return None if self.vram_budget is None else self.vram_required <= self.vram_budget

    def bytes_on(self, tier: str, plan: str = "cpu") -> int:
        """Bytes a plan ("cpu" or "gpu") keeps on a tier (tier names as in the rows)."""
        return sum(r.nbytes for r in self.rows if (r.cpu_tier if plan == "cpu" else r.gpu_tier) == tier)


def decoder_layers(gguf: GGUFFile) -> int | None:
    """Blocks run per token (block_count minus MTP blocks), or None when the file declares no MTP blocks."""
    arch = gguf.metadata.get("general.architecture")
    n_mtp = int(gguf.metadata.get(f"{arch}.nextn_predict_layers", 0))
    blocks = gguf.metadata.get(f"{arch}.block_count")
    if not n_mtp or blocks is None:
        return None
    return int(blocks) - n_mtp


def placement_table(gguf: GGUFFile, vram_bytes: int | None = None, ple_io: str = "direct") -> PlacementTable:
    """Bytes of each part of the model in `gguf` and the tier each goes to; see the module docstring.
    ple_io: how the n-gram table is read (a key of NGRAM_TIERS), which decides its tier in both plans."""
    if vram_bytes is not None and vram_bytes < 0:
        raise ValueError(f"VRAM budget must be >= 0 bytes, got {vram_bytes}")
    if ple_io not in NGRAM_TIERS:
        raise ValueError(f"ple_io must be one of {', '.join(NGRAM_TIERS)}, got {ple_io!r}")
    table_tier = {NGRAM_TABLE: NGRAM_TIERS[ple_io]}
    cpu_tiers, gpu_tiers = CPU_TIERS | table_tier, GPU_TIERS | table_tier
    n_layers = decoder_layers(gguf)
    counts = dict.fromkeys(PARTS, 0)
    sizes = dict.fromkeys(PARTS, 0)
    for name, info in gguf.tensors.items():
        part = tensor_part(name, n_layers)
        counts[part] += 1
        sizes[part] += int(info.data.nbytes)
    rows = [PlacementRow(p, counts[p], sizes[p], cpu_tiers[p], gpu_tiers[p]) for p in PARTS if counts[p]]
    required = sum(r.nbytes for r in rows if r.gpu_tier == VRAM)
    routed = sizes[ROUTED_EXPERTS]
    cache = 0 if vram_bytes is None else max(0, min(routed, vram_bytes - required))
    return PlacementTable(rows, sum(sizes.values()), vram_bytes, required, cache, routed)
