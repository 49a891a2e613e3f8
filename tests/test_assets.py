"""The shared test assets are what they claim to be: the tokenizer files reproduce llama.cpp's own tokenizer
test, the converted GGUF files are laid out like real Qwen3-Next / Qwen3-MoE files (and hold the checkpoint's
weights with the converter's transformations), the quantized files hold the intended types, and the transformers
reference agrees with itself between its chunked prefill and its cached decode."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import LlamaFileType
from safetensors import safe_open

import assets
from strata_async.io import open_gguf
from strata_async.io.ggml_types import type_name

LINEAR_ATTENTION_TENSORS = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_a", "ssm_dt.bias",
                            "ssm_ba.weight", "ssm_norm.weight", "ssm_out.weight")
FULL_ATTENTION_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                          "attn_q_norm.weight", "attn_k_norm.weight")
MOE_TENSORS = ("attn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
               "ffn_down_exps.weight")
SHARED_EXPERT_TENSORS = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                         "ffn_down_shexp.weight", "post_attention_norm.weight")


def checkpoint_tensors(model_dir) -> dict[str, np.ndarray]:
    (shard,) = model_dir.glob("*.safetensors")
    with safe_open(shard, framework="np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_tokenizer_reproduces_llama_cpp_tokenizer_test(qwen3moe_dir):
    """Every case of llama.cpp's test-tokenizer-0 for the Qwen2 vocabulary (models/ggml-vocab-qwen2.gguf.inp/.out)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3moe_dir)
    fixture = assets.qwen2_vocab_fixture()
    texts = fixture.with_name(fixture.name + ".inp").read_bytes().decode("utf-8").split("\n__ggml_vocab_test__\n")
    expected = fixture.with_name(fixture.name + ".out").read_bytes().decode("utf-8").split("\n")
    assert texts[-1] == expected[-1] == ""  # both files end with a separator
    assert len(texts) == len(expected) > 40
    for text, ids in zip(texts[:-1], expected[:-1]):
        assert tokenizer.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()], repr(text)
    assert tokenizer.eos_token == assets.QWEN_EOS and tokenizer.pad_token == assets.QWEN_PAD


def test_qwen3next_conversion_looks_like_a_real_file(qwen3next_dir, qwen3next_f32_gguf):
    config = assets.TINY_QWEN3NEXT
    n_layers = config["num_hidden_layers"]
    with open_gguf(qwen3next_f32_gguf) as f:
        md, tensors = f.metadata, f.tensors
        assert md["general.architecture"] == "qwen3next"
        assert md["qwen3next.block_count"] == n_layers
        assert md["qwen3next.expert_count"] == config["num_experts"]
        assert md["qwen3next.expert_used_count"] == config["num_experts_per_tok"]
        assert md["qwen3next.expert_shared_feed_forward_length"] == config["shared_expert_intermediate_size"]
        assert md["qwen3next.ssm.conv_kernel"] == config["linear_conv_kernel_dim"]
        assert md["qwen3next.ssm.time_step_rank"] == config["linear_num_value_heads"]
        assert md["qwen3next.rope.dimension_count"] == config["head_dim"] // 4
        recurrent = [t == "linear_attention" for t in config["layer_types"]]
        assert list(np.asarray(md["qwen3next.attention.recurrent_layers"], bool)) == recurrent
        assert 2 <= sum(recurrent) < n_layers
        assert_qwen_vocabulary(md)

        for layer, is_recurrent in enumerate(recurrent):
            mixer = LINEAR_ATTENTION_TENSORS if is_recurrent else FULL_ATTENTION_TENSORS
            absent = FULL_ATTENTION_TENSORS if is_recurrent else LINEAR_ATTENTION_TENSORS
            for suffix in mixer + MOE_TENSORS + SHARED_EXPERT_TENSORS:
                assert f"blk.{layer}.{suffix}" in tensors
            assert not any(f"blk.{layer}.{suffix}" in tensors for suffix in absent)
        assert_expert_shapes(tensors, config)
        assert {type_name(t.ggml_type) for t in tensors.values()} == {"F32"}

        # The converter's transformations of the checkpoint's (randomised) values.
        hf = checkpoint_tensors(qwen3next_dir)
        norm = hf["model.layers.0.input_layernorm.weight"]
        assert norm.std() > 0.1  # randomised, so the +1 offset is visible
        np.testing.assert_array_equal(gguf_values(tensors["blk.0.attn_norm.weight"]), norm + 1)
        np.testing.assert_array_equal(gguf_values(tensors["blk.0.ssm_norm.weight"]),
                                      hf["model.layers.0.linear_attn.norm.weight"])
        np.testing.assert_allclose(gguf_values(tensors["blk.0.ssm_a"]),
                                   -np.exp(hf["model.layers.0.linear_attn.A_log"]), rtol=1e-6)
        np.testing.assert_array_equal(gguf_values(tensors["blk.0.ssm_dt.bias"]),
                                      hf["model.layers.0.linear_attn.dt_bias"])


def test_qwen3moe_conversion_looks_like_a_real_file(qwen3moe_dir, qwen3moe_f32_gguf):
    config = assets.TINY_QWEN3MOE
    with open_gguf(qwen3moe_f32_gguf) as f:
        md, tensors = f.metadata, f.tensors
        assert md["general.architecture"] == "qwen3moe"
        assert md["qwen3moe.block_count"] == config["num_hidden_layers"]
        assert md["qwen3moe.expert_count"] == config["num_experts"]
        assert md["qwen3moe.expert_used_count"] == config["num_experts_per_tok"]
        assert md["qwen3moe.attention.key_length"] == config["head_dim"]
        assert_qwen_vocabulary(md)
        for layer in range(config["num_hidden_layers"]):
            for suffix in FULL_ATTENTION_TENSORS + MOE_TENSORS + ("ffn_norm.weight",):
                assert f"blk.{layer}.{suffix}" in tensors
        assert_expert_shapes(tensors, config)

        hf = checkpoint_tensors(qwen3moe_dir)
        norm = hf["model.layers.0.post_attention_layernorm.weight"]
        assert norm.std() > 0.1
        np.testing.assert_array_equal(gguf_values(tensors["blk.0.ffn_norm.weight"]), norm)  # no offset here
        np.testing.assert_array_equal(gguf_values(tensors["blk.1.ffn_gate_exps.weight"])[5],
                                      hf["model.layers.1.mlp.experts.5.gate_proj.weight"])


def assert_qwen_vocabulary(md: dict) -> None:
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert md["tokenizer.ggml.pre"] == "qwen2"
    assert len(md["tokenizer.ggml.tokens"]) == assets.QWEN_VOCAB_SIZE
    assert len(md["tokenizer.ggml.merges"]) > 150_000
    assert md["tokenizer.ggml.eos_token_id"] == assets.QWEN_EOS_ID
    assert md["tokenizer.ggml.tokens"][assets.QWEN_EOS_ID] == assets.QWEN_EOS


def assert_expert_shapes(tensors: dict, config: dict) -> None:
    n_expert, n_embd, n_ff = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    for layer in range(config["num_hidden_layers"]):
        assert tensors[f"blk.{layer}.ffn_gate_exps.weight"].shape == (n_expert, n_ff, n_embd)
        assert tensors[f"blk.{layer}.ffn_up_exps.weight"].shape == (n_expert, n_ff, n_embd)
        assert tensors[f"blk.{layer}.ffn_down_exps.weight"].shape == (n_expert, n_embd, n_ff)
        assert tensors[f"blk.{layer}.ffn_gate_inp.weight"].shape == (n_expert, n_embd)


def gguf_values(tensor) -> np.ndarray:
    assert type_name(tensor.ggml_type) == "F32"
    return np.frombuffer(tensor.data, np.float32).reshape(tensor.shape)


# Per llama-quantize type: its file type, the type of token_embd, and the types its tensors may hold in a file with
# 256-multiple rows (llama.cpp keeps norms, routers, conv, ssm_a and dt in F32, uses Q8_0 for attention K/V/QKV of
# models with 8+ experts, and mixes in higher K-quants for the output head and some layers).
QUANT_TYPES = {
    "Q4_K_M": (LlamaFileType.MOSTLY_Q4_K_M, "Q4_K", {"Q4_K", "Q5_K", "Q6_K", "Q8_0"}),
    "Q6_K": (LlamaFileType.MOSTLY_Q6_K, "Q6_K", {"Q6_K", "Q8_0"}),
    "Q2_K": (LlamaFileType.MOSTLY_Q2_K, "Q2_K", {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"}),
    "Q4_0": (LlamaFileType.MOSTLY_Q4_0, "Q4_0", {"Q4_0", "Q6_K", "Q8_0"}),
    "Q8_0": (LlamaFileType.MOSTLY_Q8_0, "Q8_0", {"Q8_0"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_key", ["qwen3next_kquant", "qwen3moe_kquant"])
@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_quantized_files_hold_the_intended_types(quantized, converted, model_key, qtype):
    file_type, embedding_type, allowed = QUANT_TYPES[qtype]
    with open_gguf(converted(model_key, "f32")) as src, open_gguf(quantized(model_key, qtype)) as f:
        assert f.metadata["general.file_type"] == int(file_type)
        assert f.metadata["general.architecture"] == src.metadata["general.architecture"]
        assert sorted(f.tensors) == sorted(src.tensors)
        types = {name: type_name(t.ggml_type) for name, t in f.tensors.items()}
        assert set(types.values()) - {"F32"} <= allowed, f"{qtype}: fallback types {set(types.values()) - allowed}"
        assert types["token_embd.weight"] == embedding_type
        assert types["blk.0.ffn_gate_exps.weight"] in allowed
        for name, t in src.tensors.items():
            if len(t.shape) == 1:  # norms, ssm_a, ssm_dt.bias stay F32
                assert types[name] == "F32", name
            # llama-quantize drops trailing unit axes: ffn_gate_inp_shexp (1, n_embd) comes back as (n_embd,)
            assert f.tensors[name].n_elements == t.n_elements, name


def test_transformers_reference_agrees_with_itself(qwen3next_dir):
    """hf_greedy decodes with the cache (recurrent DeltaNet step, cached attention); in a teacher-forced forward
    of the prompt and those tokens (chunked DeltaNet) each chosen token must be the argmax, up to rounding noise."""
    prompt = np.random.default_rng().integers(0, assets.QWEN_BOS_ID, 20)
    generated = assets.hf_greedy(qwen3next_dir, prompt, 8)
    logits = assets.hf_reference_logits(qwen3next_dir, np.concatenate([prompt, generated]))
    assert logits.shape == (len(prompt) + len(generated), assets.QWEN_VOCAB_SIZE)
    assert logits.dtype == np.float64 and np.isfinite(logits).all()
    assert logits.std(axis=-1).min() > 0.5  # far from uniform: argmaxes are meaningful
    next_token = logits[len(prompt) - 1:-1]
    chosen = next_token[np.arange(len(generated)), generated]
    np.testing.assert_array_less(next_token.max(axis=-1) - chosen, 1e-3)
    assert len(set(logits.argmax(axis=-1).tolist())) > len(logits) // 2
