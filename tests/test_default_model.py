"""The embedded default model: deterministic bytes, llama.cpp's qwen3next layout (checked against the
converter's own output), a valid byte-level BPE vocabulary, clearly labelled random weights, cached and
rebuilt as documented."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, TokenType

from strata_async import default_model as dm
from strata_async.io import open_gguf, write_gguf

import assets


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return dm.build_default_model(tmp_path_factory.mktemp("default") / "default.gguf")


@pytest.fixture(scope="module")
def gguf(built):
    with open_gguf(built) as f:
        yield f


def test_two_builds_are_identical_small_and_fast(tmp_path, built):
    started = time.perf_counter()
    again = dm.build_default_model(tmp_path / "again.gguf")
    assert time.perf_counter() - started < 2.0
    assert again.read_bytes() == built.read_bytes()
    assert 1 << 20 < built.stat().st_size < 8 << 20
    assert [p.name for p in tmp_path.iterdir()] == ["again.gguf"]  # no temporary file left behind


def test_labelled_random_weights(gguf):
    assert "random weights" in gguf.metadata["general.name"]
    assert gguf.metadata[dm.VERSION_KEY] == dm.DEFAULT_MODEL_VERSION
    assert gguf.metadata["general.architecture"] == "qwen3next"


def test_layout_follows_llama_cpp_loader(gguf):
    """Shapes as llama.cpp's qwen3next loader (src/models/qwen3next.cpp) creates them, ne reversed."""
    md, t = gguf.metadata, gguf.tensors
    h, e, ff = md["qwen3next.embedding_length"], md["qwen3next.expert_count"], md["qwen3next.expert_feed_forward_length"]
    k_heads, v_heads, state = md["qwen3next.ssm.group_count"], md["qwen3next.ssm.time_step_rank"], md["qwen3next.ssm.state_size"]
    key_dim, value_dim = k_heads * state, v_heads * state
    n_layers = md["qwen3next.block_count"] - md["qwen3next.nextn_predict_layers"]
    recurrent = list(md["qwen3next.attention.recurrent_layers"])
    assert recurrent == [(i + 1) % md["qwen3next.full_attention_interval"] != 0 and i < n_layers
                         for i in range(md["qwen3next.block_count"])]
    vocab = len(md["tokenizer.ggml.tokens"])
    assert t["token_embd.weight"].shape == t["output.weight"].shape == (vocab, h)
    for il in range(md["qwen3next.block_count"]):
        b = f"blk.{il}"
        if recurrent[il]:
            assert t[f"{b}.attn_qkv.weight"].shape == (2 * key_dim + value_dim, h)
            assert t[f"{b}.attn_gate.weight"].shape == (value_dim, h)
            assert t[f"{b}.ssm_conv1d.weight"].shape == (2 * key_dim + value_dim, md["qwen3next.ssm.conv_kernel"])
            assert t[f"{b}.ssm_ba.weight"].shape == (2 * v_heads, h)
            assert t[f"{b}.ssm_out.weight"].shape == (h, value_dim)
            assert t[f"{b}.ssm_a"].shape == t[f"{b}.ssm_dt.bias"].shape == (v_heads,)
            assert (t[f"{b}.ssm_a"].data.view(np.float32) < 0).all()  # the converter stores -exp(A_log)
        else:
            hd, nh = md["qwen3next.attention.key_length"], md["qwen3next.attention.head_count"]
            kv = md["qwen3next.attention.head_count_kv"]
            assert t[f"{b}.attn_q.weight"].shape == (2 * nh * hd, h)  # queries + output gate
            assert t[f"{b}.attn_k.weight"].shape == t[f"{b}.attn_v.weight"].shape == (kv * hd, h)
            assert t[f"{b}.attn_output.weight"].shape == (h, nh * hd)
        assert t[f"{b}.ffn_gate_exps.weight"].shape == t[f"{b}.ffn_up_exps.weight"].shape == (e, ff, h)
        assert t[f"{b}.ffn_down_exps.weight"].shape == (e, h, ff)
        assert t[f"{b}.ffn_gate_inp.weight"].shape == (e, h)
        assert t[f"{b}.ffn_gate_inp_shexp.weight"].shape == (1, h)
        if il >= n_layers:
            assert t[f"{b}.nextn.eh_proj.weight"].shape == (h, 2 * h)
    for name, info in t.items():
        expected = GGMLQuantizationType.Q8_0 if len(info.shape) > 1 and "gate_inp" not in name and "conv1d" not in name \
            else GGMLQuantizationType.F32
        assert info.ggml_type == expected, name


def test_vocabulary_is_valid_byte_level_bpe(gguf):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    md = gguf.metadata
    tokens, types = md["tokenizer.ggml.tokens"], np.asarray(md["tokenizer.ggml.token_type"])
    merges = md["tokenizer.ggml.merges"]
    assert tokens[:256] == list(bytes_to_unicode().values())  # GPT-2's byte order, as Qwen's vocabulary
    assert 300 <= len(merges) and len(tokens) % 128 == 0 and len(tokens) < 2048
    index = {tok: i for i, tok in enumerate(tokens)}
    for merge in merges:
        left, right = merge.split(" ")
        assert left in index and right in index and left + right in index, merge
    for name in dm.SPECIAL_TOKENS:
        assert types[index[name]] == TokenType.CONTROL
    assert tokens[md["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert tokens[md["tokenizer.ggml.bos_token_id"]] == tokens[md["tokenizer.ggml.padding_token_id"]] == "<|endoftext|>"
    assert all(tok.startswith("[PAD") for tok, ty in zip(tokens, types) if ty == TokenType.UNUSED)
    assert md["tokenizer.ggml.pre"] == "qwen2" and md["tokenizer.ggml.model"] == "gpt2"

    # The `tokenizers` library accepts the vocabulary and merges and makes words out of them.
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens) if types[i] == TokenType.NORMAL},
                               merges=[tuple(m.split(" ")) for m in merges]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    encoding = bpe.encode(" the model of the world")
    assert encoding.tokens == ["Ġthe", "Ġmodel", "Ġof", "Ġthe", "Ġworld"]


def test_chat_template_is_chatml(gguf):
    from strata_async.tokenizer import Tokenizer

    text = Tokenizer.from_gguf(gguf).render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("STRATA_ASYNC_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cache_dir() == tmp_path / "xdg" / "strata-async"
    monkeypatch.setenv("STRATA_ASYNC_HOME", str(tmp_path / "home"))
    assert dm.cache_dir() == tmp_path / "home"
    monkeypatch.delenv("STRATA_ASYNC_HOME")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert dm.cache_dir() == tmp_path / "user" / ".cache" / "strata-async"


def test_built_on_first_use_and_rebuilt_when_stale(monkeypatch, tmp_path, built):
    monkeypatch.setenv("STRATA_ASYNC_HOME", str(tmp_path))
    path = dm.default_model_path()
    assert path.parent == tmp_path and path.read_bytes() == built.read_bytes()
    mtime = path.stat().st_mtime_ns
    assert dm.default_model_path() == path and path.stat().st_mtime_ns == mtime  # cached: not rebuilt

    write_gguf(path, {dm.VERSION_KEY: dm.DEFAULT_MODEL_VERSION + 1}, [])  # same name, other version tag
    assert dm.default_model_path() == path and path.read_bytes() == built.read_bytes()

    path.write_bytes(b"GGUF truncated")
    assert dm.default_model_path() == path and path.read_bytes() == built.read_bytes()

    old = tmp_path / f"default-qwen3next-v{dm.DEFAULT_MODEL_VERSION - 1}.gguf"
    old.write_bytes(b"an older default model")
    path.unlink()
    dm.default_model_path()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # stale versions are removed


@pytest.mark.slow
def test_runtime_gives_non_degenerate_logits(built, rng):
    import strata_async

    with strata_async.load(built) as model:
        ids = rng.integers(0, 800, size=12)
        logits = model.logits(ids.tolist()).astype(np.float64)
    assert np.isfinite(logits).all()
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    entropy = -(probs * np.log(probs + 1e-300)).sum(axis=1)
    assert (logits.std(axis=1) > 1.0).all()
    # Neither one-hot nor flat. A random model is sometimes confident at one position (over 450 random prompts
    # the lowest entropy at any position was 0.10 nats, and it fell below 0.5 in ~5% of prompts), so the bar
    # on every position is "not one-hot" and the typical position must be far from it (median seen >= 2.85).
    assert (entropy > 0.01).all() and np.median(entropy) > 1.0
    assert (entropy < 0.9 * np.log(logits.shape[1])).all()
    assert len(set(np.argmax(logits, axis=1).tolist())) > 3  # the argmax moves with the input


# ---------------------------------------------------------------------------------------------------------------
# Against llama.cpp's converter: a transformers checkpoint with the default model's sizes (and an MTP block, as
# the real Qwen3-Next checkpoints carry), converted with --outtype q8_0
# ---------------------------------------------------------------------------------------------------------------

HF_DIMS = dict(
    hidden_size=dm.DIMS.hidden, num_hidden_layers=dm.DIMS.n_layers, num_attention_heads=dm.DIMS.n_heads,
    num_key_value_heads=dm.DIMS.n_kv_heads, head_dim=dm.DIMS.head_dim, linear_num_key_heads=dm.DIMS.linear_k_heads,
    linear_num_value_heads=dm.DIMS.linear_v_heads, linear_key_head_dim=dm.DIMS.linear_head_dim,
    linear_value_head_dim=dm.DIMS.linear_head_dim, linear_conv_kernel_dim=dm.DIMS.conv_kernel,
    num_experts=dm.DIMS.n_experts, num_experts_per_tok=dm.DIMS.n_experts_used,
    moe_intermediate_size=dm.DIMS.expert_ffn, shared_expert_intermediate_size=dm.DIMS.shared_ffn,
    intermediate_size=dm.DIMS.dense_ffn, max_position_embeddings=dm.DIMS.context_length,
)


def _with_mtp_block(base: Path, out: Path) -> None:
    """`base` plus an `mtp.*` block (a copy of its last full-attention layer, fc and norms), as Qwen ships it."""
    from safetensors.numpy import load_file, save_file

    out.mkdir()
    for item in base.iterdir():
        os.symlink(item, out / item.name)
    weights = {}
    for shard in base.glob("*.safetensors"):
        weights.update(load_file(shard))
    last = dm.DIMS.n_layers - 1
    prefix = f"model.layers.{last}."
    mtp = {"mtp.layers.0." + k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    h = dm.DIMS.hidden
    rng = np.random.default_rng(0)
    mtp["mtp.fc.weight"] = rng.standard_normal((h, 2 * h)).astype(np.float32)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = rng.standard_normal(h).astype(np.float32) * 0.1
    save_file(mtp, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def converted():
    base = assets.tiny_qwen3next_dir(**HF_DIMS)
    with_mtp = assets._build_once(base.with_name(base.name + "-mtp"), lambda out: _with_mtp_block(base, out))
    with open_gguf(assets.converted_gguf(with_mtp, "q8_0")) as f:
        yield f


@pytest.mark.slow
def test_same_tensors_as_the_converter(gguf, converted):
    assert sorted(gguf.tensors) == sorted(converted.tensors)  # (the order follows the checkpoint's files)
    vocab_rows = {"token_embd.weight", "output.weight"}
    for name, ours in gguf.tensors.items():
        theirs = converted.tensors[name]
        assert ours.ggml_type == theirs.ggml_type, name
        if name in vocab_rows:  # our vocabulary is smaller than Qwen's
            assert ours.shape[1:] == theirs.shape[1:], name
        else:
            assert ours.shape == theirs.shape, name


@pytest.mark.slow
def test_same_metadata_as_the_converter(gguf, converted):
    ours, theirs = gguf.metadata, converted.metadata
    assert [k for k in ours if k != dm.VERSION_KEY] == list(theirs)  # the same keys, in the same order
    for key in theirs:
        assert gguf.metadata_types[key] == converted.metadata_types[key], key
    differs = {"general.name", "general.basename", "general.finetune", "general.size_label", "tokenizer.chat_template",
               "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
    for key in theirs:
        if key in differs or key.endswith("_token_id"):
            continue
        assert np.array_equal(np.asarray(ours[key]), np.asarray(theirs[key])), key
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id"):
        assert ours["tokenizer.ggml.tokens"][ours[key]] == theirs["tokenizer.ggml.tokens"][theirs[key]], key
