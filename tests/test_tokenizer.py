"""Tokenizer against llama.cpp's tokenizer fixtures, Hugging Face tokenizers and transformers' chat rendering."""

from __future__ import annotations

import functools
import time
import unicodedata
from pathlib import Path

import jinja2
import numpy as np
import pytest
from assets import fresh_rng, llama_cpp_dir, qwen2_tokenizer_dir
from tokenizers import Tokenizer as HFTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.utils.chat_template_utils import render_jinja_template

from strata_async.io import open_gguf
from strata_async.tokenizer import StreamDecoder, Tokenizer, TokenizerError

# Every byte-level BPE vocabulary llama.cpp ships with .inp/.out fixtures.
FIXTURE_VOCABS = ["qwen2", "qwen35", "gpt-2", "llama-bpe", "deepseek-llm", "deepseek-coder", "falcon", "starcoder",
                  "refact", "command-r", "mpt"]
CONSTRUCTION_CPU_LIMIT_S = 1.0
QWEN_ENDOFTEXT, QWEN_IM_START, QWEN_IM_END, QWEN_FIRST_PAD = 151643, 151644, 151645, 151646


def vocab_path(name: str) -> Path:
    return llama_cpp_dir() / "models" / f"ggml-vocab-{name}.gguf"


@functools.cache
def metadata(name: str) -> dict:
    return open_gguf(vocab_path(name)).metadata


@functools.cache
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(metadata(name))


@functools.cache
def hf_qwen2() -> HFTokenizer:
    """Hugging Face's tokenizer over the same Qwen2 vocabulary (NFC normalizer: feed it NFC text)."""
    return HFTokenizer.from_file(str(qwen2_tokenizer_dir() / "tokenizer.json"))


def read_fixture(name: str) -> list[tuple[str, list[int]]]:
    """Test cases of ggml-vocab-<name>.gguf.inp/.out, split as llama.cpp's test-tokenizer-0 splits them."""
    raw = vocab_path(name).with_suffix(".gguf.inp").read_text(encoding="utf-8")
    sep = "\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(raw):
        end = raw.find(sep, pos)
        if end == -1:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:end])
        pos = end + len(sep)
    lines = vocab_path(name).with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines) > 30
    return [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, lines)]


TEXT_PIECES = [
    "Hello", " world", "  ", "\n", "\r\n", "\t", "'s", "'LL", "123", "4567", "3.14", "!!", "...", "—", "«»", "é",
    "e\u0301", "ß", "Ελληνικά", "русский", "中文", "日本語", "한국어", "🦙", "👨‍👩‍👧", "🏳️‍🌈", "∑", "\u00a0", "\u3000",
    "<", "|", ">", "<|im", "_end|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", " <|im_start|> ",
]


def random_text(rng: np.random.Generator, pieces: list[str] = TEXT_PIECES, max_pieces: int = 30) -> str:
    return "".join(rng.choice(pieces, size=int(rng.integers(1, max_pieces))))


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp's fixtures
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_VOCABS)
def test_llama_cpp_fixture(name):
    tok = tokenizer(name)
    for text, expected in read_fixture(name):
        # test-tokenizer-0 tokenizes with add_special=false, parse_special=false
        ids = tok.encode(text, add_special=False, parse_special=False)
        assert ids == expected, f"{name}: {text!r}"
        assert tok.decode(ids) == text, f"{name}: {text!r}"


def test_construction_time_of_a_150k_vocabulary():
    meta = metadata("qwen2")
    start = time.process_time()
    Tokenizer.from_metadata(meta)
    cpu = time.process_time() - start
    assert cpu < CONSTRUCTION_CPU_LIMIT_S, cpu


# ---------------------------------------------------------------------------------------------------------------
# Against Hugging Face tokenizers on random text
# ---------------------------------------------------------------------------------------------------------------


def test_random_text_matches_hugging_face():
    tok, hf = tokenizer("qwen2"), hf_qwen2()
    rng, seed = fresh_rng()
    for _ in range(300):
        text = unicodedata.normalize("NFC", random_text(rng))
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, (seed, text)
        hf.encode_special_tokens = True  # Hugging Face's name for not parsing special tokens
        try:
            assert tok.encode(text, parse_special=False) == hf.encode(text, add_special_tokens=False).ids, (seed, text)
        finally:
            hf.encode_special_tokens = False


def test_decode_round_trip_on_random_text():
    rng, seed = fresh_rng()
    for name in ("qwen2", "qwen35", "llama-bpe", "deepseek-llm"):
        tok = tokenizer(name)
        for _ in range(50):
            text = random_text(rng)
            for parse_special in (True, False):
                ids = tok.encode(text, add_special=False, parse_special=parse_special)
                assert tok.decode(ids) == text, (name, seed, text)


def test_token_bytes_follow_gpt2_byte_alphabet():
    tok, meta = tokenizer("qwen2"), metadata("qwen2")
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    normal = np.flatnonzero(meta["tokenizer.ggml.token_type"] == 1)
    for i in normal.tolist():
        assert tok.token_bytes(i) == bytes(byte_of[c] for c in meta["tokenizer.ggml.tokens"][i]), i
    assert tok.token_bytes(QWEN_IM_START) == b"<|im_start|>"
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([1, -1])


# ---------------------------------------------------------------------------------------------------------------
# Special tokens
# ---------------------------------------------------------------------------------------------------------------


def test_special_tokens_are_parsed_atomically():
    tok = tokenizer("qwen2")
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == QWEN_IM_START and ids[-1] == QWEN_IM_END
    assert ids[1:-1] == tok.encode("user\nHi")
    plain = tok.encode(text, parse_special=False)
    assert QWEN_IM_START not in plain and QWEN_IM_END not in plain and tok.decode(plain) == text
    assert tok.decode(ids, skip_special=True) == "user\nHi"
    # user-defined tokens are cut out even when special tokens are not parsed (llama.cpp, Hugging Face alike)
    pad = tok.encode("a[PAD151650]b", parse_special=False)
    assert pad == tok.encode("a") + [151650] + tok.encode("b")
    assert tok.decode(pad, skip_special=True) == "a[PAD151650]b"


def test_longest_special_token_wins_and_control_tokens_need_parse_special():
    meta = dict(metadata("gpt-2"))
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["<x>", "<x><y>"]
    meta["tokenizer.ggml.token_type"] = np.concatenate([meta["tokenizer.ggml.token_type"], [4, 3]]).astype(np.int32)
    tok = Tokenizer.from_metadata(meta)
    x, xy = n, n + 1
    plain = tokenizer("gpt-2")
    assert tok.encode("1<x><y>2<x>3") == plain.encode("1") + [xy] + plain.encode("2") + [x] + plain.encode("3")
    assert tok.encode("1<x><y>2<x>3", parse_special=False) == (
        plain.encode("1") + [x] + plain.encode("<y>2") + [x] + plain.encode("3"))
    assert tok.is_special(xy) and not tok.is_special(x)


def test_special_token_ids_and_kinds():
    tok = tokenizer("qwen2")
    assert tok.vocab_size == 151936
    assert tok.bos_id == tok.eos_id == tok.pad_id == QWEN_ENDOFTEXT
    assert tok.eot_id is None and tok.eom_id is None and tok.fim_pre_id is None
    assert tok.is_special(QWEN_IM_START) and tok.is_special(QWEN_ENDOFTEXT)
    assert not tok.is_special(QWEN_FIRST_PAD) and not tok.is_special(9707)
    assert {QWEN_ENDOFTEXT, QWEN_IM_END} <= tok.eog_ids and QWEN_IM_START not in tok.eog_ids
    meta = dict(metadata("qwen2"))
    meta.update({"tokenizer.ggml.fim_pre_token_id": 151659, "tokenizer.ggml.fim_suf_token_id": 151661,
                 "tokenizer.ggml.middle_token_id": 151660, "tokenizer.ggml.fim_pad_token_id": 151662,
                 "tokenizer.ggml.fim_rep_token_id": 151663, "tokenizer.ggml.fim_sep_token_id": 151664,
                 "tokenizer.ggml.eot_token_id": QWEN_IM_END, "tokenizer.ggml.eom_token_id": 10**9})
    fim = Tokenizer.from_metadata(meta)
    assert (fim.fim_pre_id, fim.fim_suf_id, fim.fim_mid_id) == (151659, 151661, 151660)
    assert (fim.fim_pad_id, fim.fim_rep_id, fim.fim_sep_id) == (151662, 151663, 151664)
    assert fim.eot_id == QWEN_IM_END and fim.eom_id is None  # an id outside the vocabulary is dropped
    assert {151662, 151663, 151664} <= fim.eog_ids


def test_fim_tokens_are_found_by_their_text_when_metadata_names_none():
    # Real Qwen GGUFs name no FIM ids; llama.cpp then finds <|fim_prefix|> and friends by their text.
    meta = dict(metadata("qwen2"))
    tokens = list(meta["tokenizer.ggml.tokens"])
    names = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
    for i, name in enumerate(names):
        tokens[151659 + i] = name
    meta["tokenizer.ggml.tokens"] = tokens
    tok = Tokenizer.from_metadata(meta)
    assert (tok.fim_pre_id, tok.fim_mid_id, tok.fim_suf_id) == (151659, 151660, 151661)
    assert (tok.fim_pad_id, tok.fim_rep_id, tok.fim_sep_id) == (151662, 151663, 151664)
    assert {151662, 151663, 151664} <= tok.eog_ids
    meta["tokenizer.ggml.fim_pre_token_id"] = 151661  # a named id wins over the text search
    assert Tokenizer.from_metadata(meta).fim_pre_id == 151661


def test_bos_and_eos_are_added_as_the_model_asks():
    assert tokenizer("qwen2").encode("Hi") == tokenizer("qwen2").encode("Hi", add_special=False)
    llama = tokenizer("llama-bpe")  # llama3 pre-tokenizer: BOS by default
    assert llama.encode("Hi") == [128000] + llama.encode("Hi", add_special=False)
    deepseek = tokenizer("deepseek-llm")  # tokenizer.ggml.add_bos_token = true
    assert deepseek.encode("Hi")[0] == deepseek.bos_id == 100000
    meta = dict(metadata("gpt-2"))
    meta["tokenizer.ggml.add_eos_token"] = True
    assert Tokenizer.from_metadata(meta).encode("Hi") == tokenizer("gpt-2").encode("Hi") + [50256]


def test_unsupported_models_are_refused():
    with pytest.raises(TokenizerError, match="tokenizer model 'llama'.*not supported"):
        Tokenizer.from_metadata(metadata("llama-spm"))
    with pytest.raises(TokenizerError, match="pre-tokenizer 'no-such-pre'"):
        Tokenizer.from_metadata({**metadata("gpt-2"), "tokenizer.ggml.pre": "no-such-pre"})
    meta = {k: v for k, v in metadata("gpt-2").items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(TokenizerError, match="no merges"):
        Tokenizer.from_metadata(meta)


# ---------------------------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe"])
def test_stream_decoder_never_splits_a_character(name):
    tok = tokenizer(name)
    text = "Emoji 🦙🏳️‍🌈👨‍👩‍👧 and CJK 中文字符，日本語のテキスト、한국어 — façade naïve ∑∫"
    ids = tok.encode(text, add_special=False)
    assert any(tok.token_bytes(i).decode("utf-8", errors="ignore").encode() != tok.token_bytes(i) for i in ids), \
        "the text must contain tokens that hold part of a character"
    stream = StreamDecoder(tok)
    deltas = [stream.push(i) for i in ids]
    assert stream.flush() == ""
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens completed no character and were held back


def test_stream_decoder_matches_decode_on_random_tokens():
    tok = tokenizer("qwen2")
    rng, seed = fresh_rng()
    for _ in range(200):
        ids = rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 40))).tolist()
        for skip_special in (False, True):
            stream = StreamDecoder(tok, skip_special=skip_special)
            streamed = "".join(stream.push(i) for i in ids) + stream.flush()
            assert streamed == tok.decode(ids, skip_special=skip_special), (seed, ids)


def test_stream_decoder_skips_special_tokens():
    tok = tokenizer("qwen2")
    ids = tok.encode("<|im_start|>assistant\n你好<|im_end|>")
    stream = StreamDecoder(tok, skip_special=True)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "assistant\n你好"


# ---------------------------------------------------------------------------------------------------------------
# Chat templates, against transformers' rendering
# ---------------------------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello! 你好 🦙"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And \"3+3\"?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "user", "content": "Thanks"}],
]


def reference_render(template: str, messages: list, add_generation_prompt: bool, **kwargs) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS[:2])
def test_chatml_template_of_the_fixture(messages, add_generation_prompt):
    tok = tokenizer("qwen2")
    rendered = tok.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == reference_render(tok.chat_template, messages, add_generation_prompt)
    assert rendered.startswith("<|im_start|>") and rendered.endswith(
        "<|im_start|>assistant\n" if add_generation_prompt else "<|im_end|>\n")
    ids = tok.encode(rendered)
    assert ids.count(QWEN_IM_START) == rendered.count("<|im_start|>") and tok.decode(ids) == rendered


@pytest.mark.parametrize("template", ["Qwen-Qwen3-0.6B", "Qwen3.5-4B", "Qwen3-Coder", "Qwen-Qwen2.5-7B-Instruct",
                                      "meta-llama-Llama-3.1-8B-Instruct"])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_real_templates_render_as_transformers_renders_them(template, messages):
    source = (llama_cpp_dir() / "models" / "templates" / f"{template}.jinja").read_text(encoding="utf-8")
    tok = tokenizer("qwen2")
    tok.chat_template = source
    try:
        for kwargs in ({}, {"tools": TOOLS, "enable_thinking": False}):
            ours = tok.render_chat(messages, add_generation_prompt=True, **kwargs)
            reference = reference_render(source, messages, True, bos_token=tok.decode([tok.bos_id]),
                                         eos_token=tok.decode([tok.eos_id]), **kwargs)
            assert ours == reference
    finally:
        tok.chat_template = metadata("qwen2")["tokenizer.chat_template"]


def test_template_helpers():
    tok = Tokenizer.from_metadata(metadata("gpt-2"))
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('bad role: ' + m.content) }}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% if loop.index >= 2 %}{% break %}{% endif %}\n"
        "{% endfor %}{{ strftime_now('%Y') }}|{{ eos_token }}|{{ tools is defined }}{{ documents is none }}"
    )
    messages = [{"role": "user", "content": "é \"<b>\""}, {"role": "assistant", "content": "x"}, {"role": "user"}]
    assert tok.render_chat(messages) == reference_render(tok.chat_template, messages, True, eos_token="<|endoftext|>")
    with pytest.raises(jinja2.TemplateError, match="bad role: boom"):
        tok.render_chat([{"role": "bad", "content": "boom"}])
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.render_chat([])
