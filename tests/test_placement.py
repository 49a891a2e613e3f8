"""Placement table: part of each tensor, bytes per part (sizes from gguf-py's block table) and tiers."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata_async.io import open_gguf, write_gguf
from strata_async.runtime.placement import (
    HOST_RAM, NVME, PARTS, PINNED_HOST_RAM, VRAM, placement_table, tensor_part,
)

RNG = np.random.default_rng()
F32, F16, Q8_0, Q4_K = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0,
                        GGMLQuantizationType.Q4_K)

H, E, FF, V = 256, 8, 256, 512
N_LAYERS, N_MTP = 3, 1

# (name, ggml type, numpy shape, part it must land in)
SPEC = [
    ("token_embd.weight", Q8_0, (V, H), "embeddings"),
    ("output.weight", Q4_K, (V, H), "output head"),
    ("output_norm.weight", F32, (H,), "output head"),
    ("output_hc_norm.weight", F32, (4, H), "output head"),
    ("per_layer_token_embd.weight", Q8_0, (4 * V, 256), "n-gram table"),
    ("rope_freqs.weight", F32, (16,), "dense"),
]
for il in range(N_LAYERS + N_MTP):
    mtp = il >= N_LAYERS
    b = f"blk.{il}"

    def part(p: str) -> str:
        return "MTP layer" if mtp else p

    SPEC += [
        (f"{b}.attn_norm.weight", F32, (H,), part("dense")),
        (f"{b}.attn_q.weight", F16, (2 * H, H), part("dense")),
        (f"{b}.ssm_conv1d.weight", F32, (3 * H, 4), part("dense")),
        (f"{b}.hc_attn_down.weight", F32, (8, 4 * H), part("dense")),
        (f"{b}.ple_key.weight", Q8_0, (H, H), part("dense")),
        (f"{b}.ffn_gate_inp.weight", F32, (E, H), part("routers")),
        (f"{b}.ffn_gate_inp_shexp.weight", F32, (1, H), part("routers")),
        (f"{b}.ffn_up_shexp.weight", Q8_0, (FF, H), part("shared experts")),
        (f"{b}.ffn_down_shexp.weight", Q4_K, (H, FF), part("shared experts")),
        (f"{b}.ffn_gate_exps.weight", Q4_K, (E, FF, H), part("routed experts")),
        (f"{b}.ffn_down_exps.weight", Q8_0, (E, H, FF), part("routed experts")),
    ]
    if mtp:
        SPEC += [(f"{b}.nextn.eh_proj.weight", Q8_0, (H, 2 * H), "MTP layer"),
                 (f"{b}.nextn.enorm.weight", F32, (H,), "MTP layer")]


def nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return int(np.prod(shape)) // block_elems * block_bytes


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("placement") / "synthetic.gguf"
    tensors = [(name, int(t), shape, RNG.integers(0, 256, nbytes(t, shape), dtype=np.uint8))
               for name, t, shape, _ in SPEC]
    metadata = {"general.architecture": "qwen4exp", "qwen4exp.block_count": N_LAYERS + N_MTP,
                "qwen4exp.nextn_predict_layers": N_MTP}
    write_gguf(path, metadata, tensors)
    with open_gguf(path) as f:
        yield f


def test_every_tensor_lands_in_its_part(synthetic):
    for name, _, _, part in SPEC:
        assert tensor_part(name, N_LAYERS) == part, name


def test_bytes_and_counts_per_part(synthetic):
    table = placement_table(synthetic)
    want_bytes = dict.fromkeys(PARTS, 0)
    want_count = dict.fromkeys(PARTS, 0)
    for _, t, shape, part in SPEC:
        want_bytes[part] += nbytes(t, shape)
        want_count[part] += 1
    assert [r.part for r in table.rows] == [p for p in PARTS if want_count[p]]
    for row in table.rows:
        assert (row.nbytes, row.n_tensors) == (want_bytes[row.part], want_count[row.part]), row.part
    assert table.total_bytes == sum(want_bytes.values())
    assert table.routed_expert_bytes == want_bytes["routed experts"]


def test_tiers(synthetic):
    table = placement_table(synthetic)
    cpu = {r.part: r.cpu_tier for r in table.rows}
    gpu = {r.part: r.gpu_tier for r in table.rows}
    assert cpu["n-gram table"] == NVME and all(t == HOST_RAM for p, t in cpu.items() if p != "n-gram table")
    assert gpu["routed experts"] == PINNED_HOST_RAM
    assert gpu["embeddings"] == HOST_RAM
    assert gpu["n-gram table"] == NVME
    for p in ("dense", "routers", "shared experts", "output head", "MTP layer"):
        assert gpu[p] == VRAM, p
    assert table.bytes_on(NVME) == table.bytes_on(NVME, "gpu") == next(
        r.nbytes for r in table.rows if r.part == "n-gram table")


def test_vram_budget_sizes_the_expert_cache(synthetic):
    unbounded = placement_table(synthetic)
    assert unbounded.vram_budget is None and unbounded.fits_vram is None and unbounded.expert_cache_bytes == 0
    required = unbounded.vram_required
    assert required == sum(r.nbytes for r in unbounded.rows if r.gpu_tier == VRAM)
    routed = unbounded.routed_expert_bytes

    spare = int(RNG.integers(1, routed))
    partial = placement_table(synthetic, vram_bytes=required + spare)
    assert partial.fits_vram and partial.expert_cache_bytes == spare

    roomy = placement_table(synthetic, vram_bytes=required + routed + 12345)
    assert roomy.fits_vram and roomy.expert_cache_bytes == routed

    short = placement_table(synthetic, vram_bytes=required - 1)
    assert short.fits_vram is False and short.expert_cache_bytes == 0

    with pytest.raises(ValueError, match="VRAM budget"):
        placement_table(synthetic, vram_bytes=-1)


def test_without_mtp_metadata_high_blocks_stay_in_the_trunk():
    assert tensor_part("blk.47.attn_q.weight") == "dense"
    assert tensor_part("blk.47.attn_q.weight", 47) == "MTP layer"
    assert tensor_part("blk.3.nextn.hnorm.weight") == "MTP layer"
