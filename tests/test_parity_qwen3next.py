"""Qwen3-Next end to end: llama.cpp-converted GGUF files against transformers, quantized files against their
dequantized F32 copies (the checks are in parity.ParitySuite), and the older fused DeltaNet input layout."""

import numpy as np
from gguf import GGMLQuantizationType
from safetensors import safe_open

from parity import PREFILL_CHUNK, ParitySuite, max_rel_diff, random_prompt, rewrite_gguf
from strata_async.runtime import load_runtime


class TestQwen3NextParity(ParitySuite):
    model_key = "qwen3next"
    kquant_key = "qwen3next_kquant"


def test_legacy_fused_qkvz_layout(qwen3next_dir, qwen3next_f32_gguf, tmp_path):
    """Files from converters before the attn_qkv/attn_gate split hold transformers' in_proj_qkvz unchanged as
    ssm_in (rows grouped per key head); they must give the same logits as the split layout."""
    (shard,) = qwen3next_dir.glob("*.safetensors")
    with safe_open(shard, framework="np") as f:
        in_proj = {name.split(".")[2]: f.get_tensor(name) for name in f.keys()
                   if name.endswith("linear_attn.in_proj_qkvz.weight")}

    def fuse(specs):
        for name, ggml_type, shape, data in specs:
            layer = name.split(".")[1]
            if name.endswith((".attn_qkv.weight", ".attn_gate.weight")) and layer in in_proj:
                if name.endswith(".attn_qkv.weight"):
                    w = np.ascontiguousarray(in_proj[layer], np.float32)
                    yield f"blk.{layer}.ssm_in.weight", int(GGMLQuantizationType.F32), w.shape, w
            else:
                yield name, ggml_type, shape, data

    legacy = rewrite_gguf(qwen3next_f32_gguf, tmp_path / "legacy.gguf", tensors=fuse)
    prompt = random_prompt(2 * PREFILL_CHUNK + 3)
    split_rt = load_runtime(qwen3next_f32_gguf, prefill_chunk=PREFILL_CHUNK)
    fused_rt = load_runtime(legacy, prefill_chunk=PREFILL_CHUNK)
    assert any(n.endswith("ssm_in.weight") for n in fused_rt.gguf.tensors)
    got = fused_rt.forward(fused_rt.new_state(), prompt)
    assert max_rel_diff(got, split_rt.forward(split_rt.new_state(), prompt)) <= 1e-6


def test_multi_token_prediction_block_is_not_run(qwen3next_f32_gguf, tmp_path):
    """A file converted with its MTP block holds it as one more block (block_count + nextn_predict_layers, a
    full-attention layer plus nextn.* tensors); the trunk's logits must not change."""
    with_mtp_md = {}

    def metadata(md):
        n = int(md["qwen3next.block_count"][1])
        kind, recurrent = md["qwen3next.attention.recurrent_layers"]
        with_mtp_md.update(md, **{
            "qwen3next.block_count": (md["qwen3next.block_count"][0], n + 1),
            "qwen3next.nextn_predict_layers": (md["qwen3next.block_count"][0], 1),
            "qwen3next.attention.recurrent_layers": (kind, np.append(np.asarray(recurrent), False)),
        })
        return with_mtp_md

    def tensors(specs):
        specs = list(specs)
        n = 1 + max(int(name.split(".")[1]) for name, *_ in specs if name.startswith("blk."))
        attn = next(i for i in range(n) if any(name == f"blk.{i}.attn_q.weight" for name, *_ in specs))
        rng = np.random.default_rng()
        hidden = next(shape[0] for name, _, shape, _ in specs if name == "output_norm.weight")
        extra = [(name.replace(f"blk.{attn}.", f"blk.{n}.", 1), t, shape, data)
                 for name, t, shape, data in specs if name.startswith(f"blk.{attn}.")]
        f32 = int(GGMLQuantizationType.F32)
        extra += [(f"blk.{n}.nextn.eh_proj.weight", f32, (hidden, 2 * hidden),
                   rng.standard_normal((hidden, 2 * hidden)).astype(np.float32)),
                  (f"blk.{n}.nextn.enorm.weight", f32, (hidden,), rng.standard_normal(hidden).astype(np.float32)),
                  (f"blk.{n}.nextn.hnorm.weight", f32, (hidden,), rng.standard_normal(hidden).astype(np.float32))]
        return specs + extra

    path = rewrite_gguf(qwen3next_f32_gguf, tmp_path / "mtp.gguf", metadata=metadata, tensors=tensors)
    trunk = load_runtime(qwen3next_f32_gguf, prefill_chunk=PREFILL_CHUNK)
    with_mtp = load_runtime(path, prefill_chunk=PREFILL_CHUNK)
    assert with_mtp.config.n_layers == trunk.config.n_layers
    prompt = random_prompt(PREFILL_CHUNK + 3)
    np.testing.assert_array_equal(with_mtp.forward(with_mtp.new_state(), prompt),
                                  trunk.forward(trunk.new_state(), prompt))
