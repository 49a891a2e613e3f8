"""Synthetic GGUFs with the real per-layer shapes of the big qwen3next models, for speed measurements.

The files are laid out exactly as llama.cpp's converter writes Qwen3-Next (tensor names, shapes, order and
metadata come from `strata_async.default_model`, the engine's own converter-shaped builder, here with real
sizes): hidden 2048, 16 query / 2 KV heads of 256, DeltaNet 16 key / 32 value heads of 128, 512 experts of
width 512 (or 640), top-10, a 512-wide shared expert and the real 151936-token vocabulary, but only a few
layers (3 DeltaNet + 1 attention + the multi-token-prediction block) so they fit in RAM.

Weights are random valid blocks, never read for their values: a type with a quantizer (gguf.quants, or
this project's Q2_0 quantizer) gets blocks drawn at random from a pool of quantized random rows; the other
types get random bytes whose fp16 scale fields are set to sane values (every code of those formats decodes
to a finite value). The router and norms are float32, as the converter writes them.

    python bench/synth_gguf.py --type Q4_K --out /tmp/synth-80b-q4_k.gguf
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, TokenType
from gguf.quants import quantize
from strata_async.io import write_gguf
from strata_async.io.ggml_types import TYPE_SIZES
from strata_async.kernels import quant  # noqa: F401  (registers every format; import before the family modules)
from strata_async.kernels.quant_legacy import Q2_0, quantize_q2_0

from strata_async import default_model
from strata_async.default_model import Dims, Vocabulary

Q = GGMLQuantizationType

# Per-layer shapes of the real models (transformers configs); layers cut to 4 + the MTP block.
SHAPES: dict[str, Dims] = {
    "qwen3next-80b": Dims(hidden=2048, n_layers=4, n_mtp_layers=1, full_attention_interval=4, n_heads=16,
                          n_kv_heads=2, head_dim=256, partial_rotary_factor=0.25, linear_k_heads=16,
                          linear_v_heads=32, linear_head_dim=128, conv_kernel=4, n_experts=512,
                          n_experts_used=10, expert_ffn=512, shared_ffn=512, dense_ffn=5120,
                          context_length=262144),
    # Qwen3.8-Flash-Next's expert width (640) in the qwen3next layout (the runtime has no qwen4exp file yet).
    "flash-next-640": Dims(hidden=2048, n_layers=4, n_mtp_layers=1, full_attention_interval=4, n_heads=16,
                           n_kv_heads=2, head_dim=256, partial_rotary_factor=0.25, linear_k_heads=16,
                           linear_v_heads=32, linear_head_dim=128, conv_kernel=4, n_experts=512,
                           n_experts_used=10, expert_ffn=640, shared_ffn=640, dense_ffn=5120,
                           context_length=262144),
}
VOCAB_SIZE = 151936

# Main type -> (type of the output head, llama.cpp's general.file_type), as llama-quantize picks them.
FILE_TYPES: dict[str, tuple[int, int]] = {
    "Q8_0": (Q.Q8_0, 7),
    "Q4_K": (Q.Q6_K, 15),  # Q4_K_M
    "Q2_K": (Q.Q6_K, 10),
    "IQ2_XS": (Q.Q6_K, 20),
    "Q2_0": (Q.Q6_K, 42),  # no llama.cpp file type exists for Q2_0; the tensors carry their type
}
_TYPE_IDS = {"Q8_0": int(Q.Q8_0), "Q4_K": int(Q.Q4_K), "Q2_K": int(Q.Q2_K), "IQ2_XS": int(Q.IQ2_XS), "Q2_0": Q2_0}

# Byte offsets of the fp16 scale fields in one block, for the types filled with random bytes: (offset, value).
# Values keep a weight's magnitude around 1e-2, like a trained matrix of fan-in 2048.
_SCALE_FIELDS: dict[int, tuple[tuple[int, float], ...]] = {
    int(Q.Q4_K): ((0, 1.5e-4), (2, 1e-4)),  # d, dmin; 6-bit scales/mins and 4-bit codes random
    int(Q.Q3_K): ((108, 1e-4),),  # d after hmask, codes, 6-bit scales
    int(Q.Q5_K): ((0, 7.5e-5), (2, 1e-4)),  # d, dmin; Q4_K's scales/mins, fifth bits and 4-bit codes random
    int(Q.Q6_K): ((208, 5e-5),),  # d after ql, qh, int8 scales
    int(Q.Q2_K): ((80, 8e-4), (82, 4e-4)),  # d, dmin after scales and codes
    int(Q.IQ2_XS): ((0, 8e-4),),  # d; then 9-bit grid indices + 7-bit sign indices (all valid) and scales
    int(Q.IQ4_XS): ((0, 1e-4),),  # d; then scales_h, scales_l and 4-bit level codes random
    int(Q.IQ4_NL): ((0, 1e-4),),  # d per 32 values; then 4-bit level codes random
    int(Q.Q5_0): ((0, 6e-4),),  # d per 32 values; then fifth bits and 4-bit codes random
    # the other i-quants: d first, then grid indices, signs and scales random (all valid)
    int(Q.IQ2_XXS): ((0, 8e-4),),
    int(Q.IQ2_S): ((0, 8e-4),),
    int(Q.IQ3_XXS): ((0, 4e-4),),
    int(Q.IQ3_S): ((0, 1e-4),),
    int(Q.IQ1_S): ((0, 1e-3),),
}
_POOL_ROWS = 512  # rows of 2048 quantized once; tensors are filled with blocks drawn from them


def _quantized_pool(ggml_type: int, rng: np.random.Generator) -> np.ndarray | None:
    """[blocks, block_bytes] of real quantizer output for random rows, or None when there is no quantizer."""
    values = (rng.standard_normal((_POOL_ROWS, 2048)) / np.sqrt(2048)).astype(np.float32)
    if ggml_type == Q2_0:
        raw = np.frombuffer(quantize_q2_0(values), np.uint8)
    elif ggml_type in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.MXFP4):
        raw = quantize(values, Q(ggml_type))
    else:
        return None
    return np.ascontiguousarray(raw).reshape(-1, TYPE_SIZES[ggml_type][1])


def random_blocks(ggml_type: int, n_blocks: int, rng: np.random.Generator, out: np.ndarray | None = None,
                  pool: np.ndarray | None = None) -> np.ndarray:
    """n_blocks valid random blocks of ggml_type as uint8 [n_blocks, block_bytes] (into ``out`` if given)."""
    block_bytes = TYPE_SIZES[ggml_type][1]
    if out is None:
        out = np.empty((n_blocks, block_bytes), np.uint8)
    step = 1 << 20  # blocks per chunk: bounded temporaries
    for b0 in range(0, n_blocks, step):
        b1 = min(n_blocks, b0 + step)
        if pool is not None:
            out[b0:b1] = pool[rng.integers(0, len(pool), b1 - b0)]
            continue
        if ggml_type not in _SCALE_FIELDS:
            raise ValueError(f"no random-block rule for ggml type {ggml_type}")
        out[b0:b1] = rng.integers(0, 256, (b1 - b0, block_bytes), dtype=np.uint8)
        for offset, value in _SCALE_FIELDS[ggml_type]:
            jitter = rng.uniform(0.5, 1.5, b1 - b0).astype(np.float16) * np.float16(value)
            out[b0:b1, offset:offset + 2] = jitter.view(np.uint8).reshape(-1, 2)
    return out


def padded_vocabulary(size: int) -> Vocabulary:
    """The default model's byte-level BPE vocabulary, padded with [PADn] tokens to the real vocabulary size."""
    v = default_model.build_vocabulary()
    real = [t for t in v.tokens if not t.startswith("[PAD")]
    tokens = real + [f"[PAD{i}]" for i in range(len(real), size)]
    types = np.concatenate([v.token_types[:len(real)],
                            np.full(size - len(real), int(TokenType.UNUSED), np.int32)])
    return Vocabulary(tokens, types, v.merges)


def _tensors(d: Dims, main_type: int, head_type: int, rng: np.random.Generator,
             scratch: Path) -> Iterator[tuple[str, int, tuple[int, ...], np.ndarray]]:
    """Every tensor of the file; big ones live in disk-backed scratch memmaps so RAM stays small."""
    init_rng = np.random.RandomState(int(rng.integers(2**31)))
    pools = {t: _quantized_pool(t, rng) for t in {main_type, head_type}}
    for name, shape, quantized in default_model._tensor_shapes(VOCAB_SIZE, d):
        if not quantized:
            yield name, int(Q.F32), shape, default_model._init(init_rng, name, shape).astype(np.float32)
            continue
        t = head_type if name == "output.weight" else main_type
        elems, block_bytes = TYPE_SIZES[t]
        n_blocks = int(np.prod(shape)) // elems
        buf = np.memmap(scratch / f"{name}.bin", np.uint8, "w+", shape=(n_blocks, block_bytes))
        random_blocks(t, n_blocks, rng, out=buf, pool=pools[t])
        yield name, t, shape, buf


def build_synthetic(path: str | os.PathLike[str], type_name: str, shape_name: str = "qwen3next-80b",
                    n_layers: int = 4, seed: int = 0) -> Path:
    """Write a synthetic file of `type_name` with the shapes `shape_name` and `n_layers` decoder layers."""
    if type_name not in FILE_TYPES:
        raise ValueError(f"type must be one of {sorted(FILE_TYPES)}, got {type_name!r}")
    d = dataclasses.replace(SHAPES[shape_name], n_layers=n_layers)
    head_type, file_type = FILE_TYPES[type_name]
    vocab = padded_vocabulary(VOCAB_SIZE)
    metadata = default_model._metadata(vocab, d)
    metadata["general.name"] = f"synthetic {shape_name} {type_name} ({n_layers} layers, random weights)"
    metadata["general.file_type"] = file_type
    del metadata[default_model.VERSION_KEY]
    path = Path(path)
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".synth-") as scratch:
        tensors = list(_tensors(d, _TYPE_IDS[type_name], int(head_type), rng, Path(scratch)))
        write_gguf(path, metadata, tensors)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", default="Q4_K", choices=sorted(FILE_TYPES))
    ap.add_argument("--shapes", default="qwen3next-80b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    print(build_synthetic(a.out, a.type, a.shapes, a.layers, a.seed))


if __name__ == "__main__":
    main()
