"""Qwen3.8-Flash-Next (qwen4exp) end to end: llama.cpp-converted files against transformers' Qwen4Exp (the
shared checks of parity.ParitySuite), plus what is its own: QSA selection at compress ratio > 1, the n-gram
hash, the PLE table's three I/O tiers, the silu output gate, and clear errors for broken tables."""

from __future__ import annotations

import assets
import numpy as np
import pytest
from gguf import GGUFValueType

from parity import (
    F32_VS_TRANSFORMERS,
    PREFILL_CHUNK,
    QUANTIZED_VS_DEQUANTIZED,
    ParitySuite,
    dequantized_copy,
    max_rel_diff,
    random_prompt,
    rewrite_gguf,
)
from strata_async.io import open_gguf
from strata_async.io.ggml_types import type_name
from strata_async.runtime import LoadOptions, load_runtime
from strata_async.runtime.ple import NGramHash
from strata_async.runtime.state import PLELayerState

EOS = assets.QWEN_EOS_ID


class TestQwen4ExpParity(ParitySuite):
    model_key = "qwen4exp"
    kquant_key = "qwen4exp_kquant"
    compiled_decode_layers = False  # its hyper-connections and PLE stay on the layered path
    hook_names = frozenset({"ple_out", "attn_out", "moe_out", "layer_out"})


def prompt_with_boundaries(n: int) -> np.ndarray:
    """A random prompt with end-of-sequence tokens inside it (document boundaries reset the n-grams)."""
    prompt = random_prompt(n)
    rng = np.random.default_rng()
    prompt[rng.choice(np.arange(1, n), size=max(1, n // 10), replace=False)] = EOS
    return prompt


def test_converted_file_keeps_the_compress_ratios(qwen4exp_f32_gguf):
    """The converter trap: read through a transformers that knows qwen4_exp, every ratio comes out 0 (dense)."""
    with open_gguf(qwen4exp_f32_gguf) as f:
        ratios = list(f.metadata["qwen4exp.attention.compress_ratios"])
        recurrent = list(f.metadata["qwen4exp.attention.recurrent_layers"])
    ratio = assets.TINY_QWEN4EXP["indexer_compress_ratio"]
    assert ratio > 1
    assert ratios == [0 if r else ratio for r in recurrent]


def test_qsa_selection_matters_and_follows_transformers(qwen4exp_dir, qwen4exp_f32_gguf, hf_reference_logits,
                                                        tmp_path):
    """With the budget (2 blocks of 4) below the prompt length the indexer drops positions: the same file read
    as dense attention (ratios 0) is far from transformers, the QSA runtime within the parity bar."""
    dense_path = rewrite_gguf(qwen4exp_f32_gguf, tmp_path / "dense.gguf", metadata=lambda md: {
        **md, "qwen4exp.attention.compress_ratios": (GGUFValueType.INT32, np.zeros(8, np.int32))})
    prompt = prompt_with_boundaries(4 * PREFILL_CHUNK + 3)
    ref = hf_reference_logits(qwen4exp_dir, prompt)
    qsa, dense = (load_runtime(p, prefill_chunk=PREFILL_CHUNK) for p in (qwen4exp_f32_gguf, dense_path))
    got = qsa.forward(qsa.new_state(), prompt)
    assert max_rel_diff(got, ref) <= F32_VS_TRANSFORMERS
    late = slice(3 * assets.TINY_QWEN4EXP["indexer_budget"], None)  # queries that see more blocks than kept
    assert max_rel_diff(dense.forward(dense.new_state(), prompt)[late], ref[late]) > 100 * F32_VS_TRANSFORMERS


def test_ngram_rows_match_transformers_hash(rng):
    """Row ids from our hash against transformers' Qwen4ExpTextNGramEmbedding (its table made to return each
    row's own id), on prompts with end-of-sequence tokens, computed in chunks that carry the context."""
    import torch
    import transformers
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    config = transformers.Qwen4ExpTextConfig(**{**assets.TINY_QWEN4EXP, "ple_layer_ids": [1]})
    ref = Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, layer_idx=0, ple_layer_index=0)
    with torch.no_grad():
        ref.ngram_embedding.weight.zero_()
        ref.ngram_embedding.weight[:, 0] = torch.arange(ref.ngram_embedding.weight.shape[0], dtype=torch.float32)
    ours = NGramHash(ngram_size=config.ngram_size, heads_per_ngram=config.heads_per_ngram, eos_id=EOS,
                     multipliers=ref.layer_multipliers.numpy(), head_offsets=ref.ngram_heads_offsets.numpy(),
                     head_sizes=ref.ngram_heads_vocab_sizes.numpy())
    for _ in range(5):
        prompt = prompt_with_boundaries(int(rng.integers(2, 40)))
        prompt[: int(rng.integers(0, 3))] = EOS  # boundaries at the very start, too
        with torch.no_grad():
            emb = ref(torch.as_tensor(prompt)[None], cache=None)[0].numpy()
        expected = emb.reshape(len(prompt), ours.n_heads, -1)[:, :, 0].astype(np.int64)
        context, got = ours.new_context(), []
        for chunk in np.array_split(prompt, int(rng.integers(1, 5))):
            if len(chunk):
                got.append(ours.row_ids(context, chunk))
                context = ours.advance(context, chunk)
        np.testing.assert_array_equal(np.concatenate(got), expected, err_msg=f"prompt {prompt.tolist()}")


def test_ple_tiers_give_identical_logits(qwen4exp_f32_gguf):
    """direct (O_DIRECT reads, no copy of the table in RAM), mmap and ram serve the same rows: identical
    logits; in direct mode the rows come through the reader and its counters move."""
    prompt, follow = prompt_with_boundaries(2 * PREFILL_CHUNK + 5), random_prompt(4)
    results = {}
    for mode in ("direct", "mmap", "ram"):
        rt = load_runtime(qwen4exp_f32_gguf, prefill_chunk=PREFILL_CHUNK,
                          options=LoadOptions(ple_io=mode, ple_cache_rows=16))
        state = rt.new_state()
        logits = [rt.forward(state, prompt)]
        logits += [rt.forward(state, np.array([t])) for t in follow]
        results[mode] = np.concatenate(logits)
        table = rt.model.ple_table
        stats = table.stats
        heads = rt.config.ngram.n_heads
        assert stats.fetches == 3 + 4  # one per prompt chunk and per decode step
        assert stats.rows_requested == (len(prompt) + 4) * heads
        assert stats.rows_read > 16  # more than the cache holds: rows were evicted and read again
        assert stats.bytes_read == stats.rows_read * table.info.row_bytes
        if mode == "direct":
            assert table.source._reader is not None and table.source._table is None
        rt.close()
    np.testing.assert_array_equal(results["direct"], results["mmap"])
    np.testing.assert_array_equal(results["direct"], results["ram"])


def test_iq4_nl_table_read_from_disk_matches_its_dequantized_copy(tmp_path):
    """The released table is IQ4_NL: llama-quantize makes one (the rest Q8_0); read row by row with O_DIRECT and
    decoded by our kernels, it must give the logits of the same file with every tensor dequantized by gguf-py."""
    path = assets.quantized_gguf(assets.kquant_qwen4exp_dir(), "Q8_0",
                                 ["--tensor-type", "per_layer_token_embd=iq4_nl"])
    with open_gguf(path) as f:
        assert type_name(f.tensors["per_layer_token_embd.weight"].ggml_type) == "IQ4_NL"
    quantized = load_runtime(path, prefill_chunk=PREFILL_CHUNK, options=LoadOptions(ple_io="direct"))
    reference = load_runtime(dequantized_copy(path, tmp_path / "dequantized.gguf"), prefill_chunk=PREFILL_CHUNK)
    prompt = prompt_with_boundaries(2 * PREFILL_CHUNK + 5)
    got = quantized.forward(quantized.new_state(), prompt)
    assert max_rel_diff(got, reference.forward(reference.new_state(), prompt)) <= QUANTIZED_VS_DEQUANTIZED
    assert quantized.model.ple_table.stats.rows_read > 0


def test_state_snapshots_carry_the_ple_context(qwen4exp_f32_gguf):
    """A compact snapshot (as the prompt cache keeps) continues exactly like the live state."""
    rt = load_runtime(qwen4exp_f32_gguf, prefill_chunk=PREFILL_CHUNK)
    prompt = prompt_with_boundaries(3 * PREFILL_CHUNK + 1)
    state = rt.new_state()
    rt.forward(state, prompt)
    snapshot = state.compact()
    assert any(isinstance(layer, PLELayerState) for layer in snapshot.layers)
    assert snapshot.nbytes == state.nbytes
    follow = random_prompt(5)
    np.testing.assert_array_equal(rt.forward(snapshot, follow), rt.forward(state, follow))


def test_silu_output_gate_matches_transformers(hf_reference_logits, tmp_path):
    """transformers' output_gate_type="silu"; llama.cpp's converter writes no gate key (its runtime assumes
    sigmoid), so the file says it with qwen4exp.ssm.output_gate."""
    model_dir = assets.tiny_qwen4exp_dir(output_gate_type="silu")
    path = rewrite_gguf(assets.converted_gguf(model_dir, "f32"), tmp_path / "silu.gguf", metadata=lambda md: {
        **md, "qwen4exp.ssm.output_gate": (GGUFValueType.STRING, "silu")})
    rt = load_runtime(path, prefill_chunk=PREFILL_CHUNK)
    prompt = random_prompt(2 * PREFILL_CHUNK + 3)
    ref = hf_reference_logits(model_dir, prompt)
    assert max_rel_diff(rt.forward(rt.new_state(), prompt), ref) <= F32_VS_TRANSFORMERS
    sigmoid_rt = load_runtime(assets.converted_gguf(model_dir, "f32"), prefill_chunk=PREFILL_CHUNK)
    assert max_rel_diff(sigmoid_rt.forward(sigmoid_rt.new_state(), prompt), ref) > 10 * F32_VS_TRANSFORMERS


def _set(md: dict, key: str, value) -> dict:
    return {**md, key: (md[key][0], value)}


@pytest.mark.parametrize("edit, message", [
    (lambda md: _set(md, "qwen4exp.embedding_length_per_layer_input", 32), "rows of 16 values"),
    (lambda md: _set(md, "qwen4exp.ple.head_vocab_sizes", np.asarray(md["qwen4exp.ple.head_vocab_sizes"][1]) * 2),
     "address rows up to"),
    (lambda md: _set(md, "qwen4exp.ple.layers", np.array([1, 5], np.int32)), "one n-gram table"),
    (lambda md: _set(md, "qwen4exp.ple.layers", np.array([3], np.int32)), "must be a DeltaNet layer"),
    (lambda md: _set(md, "qwen4exp.ple.layer_multipliers", np.array([3, 5], np.int64)), "hash constants"),
    (lambda md: _set(md, "qwen4exp.ssm.output_gate", "relu") if "qwen4exp.ssm.output_gate" in md
     else {**md, "qwen4exp.ssm.output_gate": (GGUFValueType.STRING, "relu")}, "output_gate"),
], ids=["row-size", "too-few-rows", "two-ple-layers", "ple-on-attention", "multipliers", "gate"])
def test_bad_ple_metadata_fails_at_load(qwen4exp_f32_gguf, tmp_path, edit, message):
    path = rewrite_gguf(qwen4exp_f32_gguf, tmp_path / "bad.gguf", metadata=edit)
    with pytest.raises(ValueError, match=message):
        load_runtime(path)


def test_truncated_or_unreadable_table_fails_at_load(qwen4exp_f32_gguf, tmp_path):
    data = qwen4exp_f32_gguf.read_bytes()
    with open_gguf(qwen4exp_f32_gguf) as f:
        table = f.tensors["per_layer_token_embd.weight"]
        end = table.file_offset + table.data.nbytes
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: end - table.data.nbytes // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_runtime(cut)
    with pytest.raises(ValueError, match="cannot read"):
        load_runtime(tmp_path / "missing.gguf")
