"""Bad models and bad inputs fail with errors that say what is wrong."""

from __future__ import annotations

import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from parity import random_prompt, rewrite_gguf
from strata_async.io import GGUFError
from strata_async.runtime import load_runtime


def test_unknown_architecture_lists_supported_ones(qwen3moe_f32_gguf, tmp_path):
    path = rewrite_gguf(qwen3moe_f32_gguf, tmp_path / "unknown.gguf",
                        metadata=lambda md: {**md, "general.architecture": (md["general.architecture"][0], "mamba9")})
    with pytest.raises(ValueError, match="'mamba9'.*not supported") as err:
        load_runtime(path)
    assert "qwen3moe" in str(err.value) and "qwen3next" in str(err.value)


def test_missing_tensor_is_named(qwen3moe_f32_gguf, tmp_path):
    name = "blk.1.ffn_up_exps.weight"
    path = rewrite_gguf(qwen3moe_f32_gguf, tmp_path / "missing.gguf",
                        tensors=lambda specs: [s for s in specs if s[0] != name])
    with pytest.raises(ValueError, match=re.escape(f"'{name}' is missing")):
        load_runtime(path)


def test_missing_metadata_key_is_named(qwen3moe_f32_gguf, tmp_path):
    path = rewrite_gguf(qwen3moe_f32_gguf, tmp_path / "nokey.gguf",
                        metadata=lambda md: {k: v for k, v in md.items() if k != "qwen3moe.expert_count"})
    with pytest.raises(ValueError, match=re.escape("'qwen3moe.expert_count' is missing")):
        load_runtime(path)


def test_unsupported_tensor_type_names_type_and_tensor(qwen3moe_f32_gguf, tmp_path):
    # I32 is a ggml storage type that no weight format uses, so no kernel computes with it.
    i32 = int(GGMLQuantizationType.I32)

    def as_i32(specs):
        for name, ggml_type, shape, data in specs:
            if name == "token_embd.weight":
                yield name, i32, shape, np.random.default_rng().integers(-9, 9, size=shape, dtype=np.int32)
            else:
                yield name, ggml_type, shape, data

    path = rewrite_gguf(qwen3moe_f32_gguf, tmp_path / "i32.gguf", tensors=as_i32)
    with pytest.raises(ValueError, match=r"'token_embd\.weight' is stored as I32.*no kernel"):
        load_runtime(path)


def test_truncated_file(qwen3moe_f32_gguf, tmp_path):
    data = qwen3moe_f32_gguf.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(GGUFError, match="truncated|beyond the end|past the end"):
        load_runtime(path)


@pytest.fixture(scope="module")
def small_context_runtime(qwen3moe_f32_gguf):
    return load_runtime(qwen3moe_f32_gguf, max_context=12, prefill_chunk=5)


def test_prompt_longer_than_context(small_context_runtime):
    rt = small_context_runtime
    state = rt.new_state()
    with pytest.raises(ValueError, match="13 tokens at position 0 exceed the context of 12"):
        rt.forward(state, random_prompt(13))
    assert state.position == 0  # a rejected call leaves the state untouched
    rt.forward(state, random_prompt(12), all_logits=False)
    with pytest.raises(ValueError, match="1 tokens at position 12 exceed the context of 12"):
        rt.forward(state, random_prompt(1))


def test_bad_token_lists(small_context_runtime):
    rt = small_context_runtime
    state = rt.new_state()
    with pytest.raises(ValueError, match="empty"):
        rt.forward(state, np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match=f"token id {rt.config.vocab_size} at index 1 is outside the vocabulary"):
        rt.forward(state, np.array([5, rt.config.vocab_size]))
    with pytest.raises(ValueError, match="token id -1 at index 0"):
        rt.forward(state, np.array([-1]))
    with pytest.raises(ValueError, match="1-D array of integer token ids"):
        rt.forward(state, np.array([1.0, 2.0]))
    assert state.position == 0


def test_bad_load_options(qwen3moe_f32_gguf):
    with pytest.raises(ValueError, match="prefill_chunk must be at least 1"):
        load_runtime(qwen3moe_f32_gguf, prefill_chunk=0)
    with pytest.raises(ValueError, match="max_context must be between 1 and the model's context length"):
        load_runtime(qwen3moe_f32_gguf, max_context=10**9)
    with pytest.raises(ValueError, match="threads must be between 1 and"):
        load_runtime(qwen3moe_f32_gguf, threads=0)
