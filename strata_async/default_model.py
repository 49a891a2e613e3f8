"""The embedded default model: a small qwen3next GGUF with random weights, built on first use.

Until a trained default exists, `strata_async.load()` without a path runs this model. It is laid out
exactly as llama.cpp's converter writes a Qwen3-Next checkpoint with `--outtype q8_0` (the same tensor
names, shapes, ggml types and metadata keys, including the multi-token-prediction block and the
`[PADn]` vocabulary padding), so the runtime treats it like a real file. Its outputs mean nothing:
`general.name` says "random weights, not trained", and so does everything that shows it.

The file is built deterministically (same bytes on every machine with the same numpy and gguf) into
the user's cache directory, written to a temporary name and renamed into place, and rebuilt when it is
missing, unreadable or carries another `DEFAULT_MODEL_VERSION`.
"""

from __future__ import annotations

import heapq
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, TokenType
from gguf.quants import quantize
from gguf.utility import size_label

from strata_async.io import GGUFError, open_gguf, write_gguf

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_MODEL_VERSION", "VERSION_KEY", "build_default_model", "cache_dir",
           "default_model_path"]

DEFAULT_MODEL_NAME = "strata-async default (random weights, not trained)"
# Bump whenever anything below changes the file's bytes: cached copies with another version are rebuilt.
DEFAULT_MODEL_VERSION = 1
VERSION_KEY = "strata_async.default_model.version"
ARCH = "qwen3next"
SEED = 20250101


@dataclass(frozen=True)
class Dims:
    """Sizes of the default model; every row length is a multiple of 32 (the Q8_0 block)."""

    hidden: int = 128
    n_layers: int = 4  # decoder blocks: 3 Gated DeltaNet + 1 full attention (full_attention_interval 4)
    n_mtp_layers: int = 1  # the multi-token-prediction block appended after them, as the converter does
    full_attention_interval: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.25
    linear_k_heads: int = 2
    linear_v_heads: int = 4
    linear_head_dim: int = 32
    conv_kernel: int = 4
    n_experts: int = 16
    n_experts_used: int = 4
    expert_ffn: int = 64
    shared_ffn: int = 64
    dense_ffn: int = 256  # written as feed_forward_length (config.intermediate_size); qwen3next does not use it
    context_length: int = 4096
    rope_theta: float = 10_000_000.0
    rms_eps: float = 1e-6
    vocab_multiple: int = 128  # the vocabulary is padded with [PADn] tokens to a multiple of this, like Qwen's


DIMS = Dims()


# ---------------------------------------------------------------------------------------------------------------
# Where the file lives
# ---------------------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """$STRATA_ASYNC_HOME, else $XDG_CACHE_HOME/strata-async, else ~/.cache/strata-async."""
    if home := os.environ.get("STRATA_ASYNC_HOME"):
        return Path(home)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "strata-async"
    return Path.home() / ".cache" / "strata-async"


def _file_version(path: Path) -> int | None:
    """The version tag of a cached default model, or None when the file is missing or unreadable."""
    try:
        with open_gguf(path) as f:
            return f.metadata.get(VERSION_KEY)
    except (OSError, GGUFError):
        return None


def default_model_path() -> Path:
    """Path of the default model, building it first if the cached file is missing or out of date."""
    directory = cache_dir()
    path = directory / f"default-{ARCH}-v{DEFAULT_MODEL_VERSION}.gguf"
    if _file_version(path) == DEFAULT_MODEL_VERSION:
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        build_default_model(path)
    except OSError as e:
        raise OSError(f"cannot build the default model in {directory} ({e.strerror or e}); set STRATA_ASYNC_HOME "
                      f"to a writable directory") from e
    for stale in directory.glob(f"default-{ARCH}-v*.gguf"):
        if stale != path:
            stale.unlink(missing_ok=True)
    return path


def build_default_model(path: str | os.PathLike[str]) -> Path:
    """Write the default model to `path` atomically (a temporary file in the same directory, then a rename)."""
    path = Path(path)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # per process: concurrent builds don't collide
    try:
        vocab = build_vocabulary()
        write_gguf(partial, _metadata(vocab), list(_tensors(len(vocab.tokens))))
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------------------------
# Vocabulary: byte-level BPE in GPT-2's byte-to-unicode form, Qwen's special tokens, [PADn] padding
# ---------------------------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")
BOS_TOKEN = PAD_TOKEN = "<|endoftext|>"  # as Qwen's config: bos_token_id = pad = <|endoftext|>
EOS_TOKEN = "<|im_end|>"  # Qwen instruct models end a turn (and generation) with <|im_end|>
N_MERGES = 600

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The merges are learned from these words, weighted by rank (earlier = more frequent), each seen with a
# leading space, capitalised, and at the start of a text; plus runs of spaces and newlines as in code.
_WORDS = """
the of and to in is that it for was on are as with be at by this have from or one had not but what all were
when we there can an your which their said if do will each about how up out them then she many some so these
would other into has more her two like him see time could no make than first been its who now people my made
over did down only way find use may water long little very after words called just where most know get through
back much before go good new write our used me man too any day same right look think also around another came
come work three word must because does part even place well such here take why things help put years different
away again off went old number great tell men say small every found still between name should home big give
air line set own under read last never us left end along while might next sound below saw something thought
both few those always looked show large often together asked house world going want school important until form
food keep children feet land side without boy once animals life enough took sometimes four head above kind
began almost live page got earth need far hand high year mother light parts country father let night following
picture being study second eyes soon times story boys since white days ever paper hard near sentence better best
across during today others however sure means knew try told young miles sun ways thing whole hear example heard
several change answer room sea against top turned learn point city play toward five using himself usually
model token tokens layer layers expert experts memory engine value values string list return import class self
def print true false none function data file files input output error model sample text first state cache
""".split()
_WHITESPACE_RUNS = ("  ", "    ", "        ", "\n\n", "\n    ", "\n        ")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (how byte-level BPE tokens are spelled)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return {b: mapping[b] for b in printable + [b for b in range(256) if b not in printable]}


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    token_types: np.ndarray  # int32 gguf TokenType per token
    merges: list[str]  # "left right", highest priority first

    def id_of(self, token: str) -> int:
        return self.tokens.index(token)


def _training_words() -> Counter[str]:
    """Pre-tokenized training text (pieces as Qwen2's pre-tokenizer would cut them) with their counts."""
    counts: Counter[str] = Counter()
    for rank, word in enumerate(_WORDS):
        weight = 4000 // (rank + 10)
        counts[" " + word] += weight
        counts[word] += weight // 4 + 1
        counts[" " + word.capitalize()] += weight // 8 + 1
    for rank, run in enumerate(_WHITESPACE_RUNS):
        counts[run] += 60 // (rank + 1)
    return counts


def _learn_merges(counts: Counter[str], n_merges: int) -> list[tuple[str, str]]:
    """Classic BPE training: repeatedly merge the most frequent adjacent pair (ties: smallest pair).

    Pair counts are updated only for the words a merge touches, and the best pair comes from a heap whose
    stale entries (count changed since they were pushed) are skipped, so training takes milliseconds.
    """
    byte_chars = bytes_to_unicode()
    words = [[byte_chars[b] for b in w.encode("utf-8")] for w in counts]
    weights = list(counts.values())
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}  # pair -> indices of the words it (may) occur in
    changed: set[tuple[str, str]] = set()  # pairs whose count changed since the heap last heard of them

    def account(i: int, sign: int) -> None:
        for pair in zip(words[i], words[i][1:]):
            pairs[pair] += sign * weights[i]
            changed.add(pair)
            if sign > 0:
                where.setdefault(pair, set()).add(i)

    for i in range(len(words)):
        account(i, +1)
    heap: list[tuple[int, tuple[str, str]]] = []
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        for pair in changed:
            if pairs[pair] > 0:
                heapq.heappush(heap, (-pairs[pair], pair))
        changed.clear()
        while heap and pairs[heap[0][1]] != -heap[0][0]:
            heapq.heappop(heap)  # stale: the count changed after this entry was pushed
        if not heap:
            break
        best = heapq.heappop(heap)[1]
        merges.append(best)
        joined = best[0] + best[1]
        for i in sorted(where.pop(best)):
            account(i, -1)
            symbols, j, out = words[i], 0, []
            while j < len(symbols):
                if j + 1 < len(symbols) and (symbols[j], symbols[j + 1]) == best:
                    out.append(joined)
                    j += 2
                else:
                    out.append(symbols[j])
                    j += 1
            words[i] = out
            account(i, +1)
        del pairs[best]
    return merges


def build_vocabulary() -> Vocabulary:
    """256 byte tokens, then one token per merge, then the special tokens, then [PADn] up to a round size."""
    tokens = list(bytes_to_unicode().values())
    merges = _learn_merges(_training_words(), N_MERGES)
    # Two merges can spell the same token ("t"+"he", "th"+"e"); it is one token, added once.
    tokens += dict.fromkeys(a + b for a, b in merges if a + b not in tokens)
    types = [TokenType.NORMAL] * len(tokens)
    tokens += SPECIAL_TOKENS
    types += [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    padded = -(-len(tokens) // DIMS.vocab_multiple) * DIMS.vocab_multiple
    types += [TokenType.UNUSED] * (padded - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), padded)]
    if len(set(tokens)) != len(tokens):
        raise AssertionError("default vocabulary has duplicate tokens")  # a bug in the merge learner
    return Vocabulary(tokens, np.array([int(t) for t in types], dtype=np.int32), [f"{a} {b}" for a, b in merges])


# ---------------------------------------------------------------------------------------------------------------
# Metadata and weights
# ---------------------------------------------------------------------------------------------------------------


def _tensor_shapes(vocab_size: int, d: Dims = DIMS) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, quantized) of every tensor, in the order the converter writes them."""
    h = d.hidden
    key_dim = d.linear_k_heads * d.linear_head_dim
    value_dim = d.linear_v_heads * d.linear_head_dim
    yield "output.weight", (vocab_size, h), True
    yield "token_embd.weight", (vocab_size, h), True
    for il in range(d.n_layers + d.n_mtp_layers):
        b = f"blk.{il}"
        recurrent = il < d.n_layers and (il + 1) % d.full_attention_interval != 0
        if il >= d.n_layers:
            yield f"{b}.nextn.eh_proj.weight", (h, 2 * h), True
        yield f"{b}.attn_norm.weight", (h,), False
        if recurrent:
            yield f"{b}.ssm_a", (d.linear_v_heads,), False
            yield f"{b}.ssm_conv1d.weight", (2 * key_dim + value_dim, d.conv_kernel), False
            yield f"{b}.ssm_dt.bias", (d.linear_v_heads,), False
            yield f"{b}.ssm_ba.weight", (2 * d.linear_v_heads, h), True
            yield f"{b}.attn_qkv.weight", (2 * key_dim + value_dim, h), True
            yield f"{b}.attn_gate.weight", (value_dim, h), True
            yield f"{b}.ssm_norm.weight", (d.linear_head_dim,), False
            yield f"{b}.ssm_out.weight", (h, value_dim), True
        yield f"{b}.ffn_down_exps.weight", (d.n_experts, h, d.expert_ffn), True
        yield f"{b}.ffn_gate_exps.weight", (d.n_experts, d.expert_ffn, h), True
        yield f"{b}.ffn_up_exps.weight", (d.n_experts, d.expert_ffn, h), True
        yield f"{b}.ffn_gate_inp.weight", (d.n_experts, h), False
        yield f"{b}.ffn_down_shexp.weight", (h, d.shared_ffn), True
        yield f"{b}.ffn_gate_shexp.weight", (d.shared_ffn, h), True
        yield f"{b}.ffn_up_shexp.weight", (d.shared_ffn, h), True
        yield f"{b}.ffn_gate_inp_shexp.weight", (1, h), False
        yield f"{b}.post_attention_norm.weight", (h,), False
        if not recurrent:
            yield f"{b}.attn_k_norm.weight", (d.head_dim,), False
            yield f"{b}.attn_k.weight", (d.n_kv_heads * d.head_dim, h), True
            yield f"{b}.attn_output.weight", (h, d.n_heads * d.head_dim), True
            yield f"{b}.attn_q_norm.weight", (d.head_dim,), False
            yield f"{b}.attn_q.weight", (2 * d.n_heads * d.head_dim, h), True  # queries and their output gate
            yield f"{b}.attn_v.weight", (d.n_kv_heads * d.head_dim, h), True
        if il >= d.n_layers:
            yield f"{b}.nextn.shared_head_norm.weight", (h,), False
            yield f"{b}.nextn.enorm.weight", (h,), False
            yield f"{b}.nextn.hnorm.weight", (h,), False
    yield "output_norm.weight", (h,), False


def _init(rng: np.random.RandomState, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random values shaped like a trained model's, so activations stay O(1) and the logits have spread.

    Norm weights sit around 1 (the converter stores Qwen3-Next's zero-centred norms as 1 + w); matrices
    are N(0, 1/fan_in); the output head is scaled so logits have a standard deviation of about 3, which
    gives a peaked but not one-hot next-token distribution.
    """
    fan_in = shape[-1]
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name.endswith(".ssm_a"):
        return -rng.uniform(1.0, 16.0, shape)  # -exp(A_log) with A drawn as transformers initialises it
    if name.endswith(".ssm_dt.bias"):
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name == "token_embd.weight":
        return rng.standard_normal(shape)
    if name == "output.weight":
        return rng.standard_normal(shape) * (3.0 / np.sqrt(fan_in))
    return rng.standard_normal(shape) / np.sqrt(fan_in)


def _tensors(vocab_size: int) -> Iterator[tuple[str, int, tuple[int, ...], np.ndarray]]:
    # RandomState, not Generator: numpy guarantees its streams never change, so the bytes stay stable.
    rng = np.random.RandomState(SEED)
    for name, shape, quantized in _tensor_shapes(vocab_size):
        values = _init(rng, name, shape).astype(np.float32)
        if quantized:
            yield name, int(GGMLQuantizationType.Q8_0), shape, quantize(values, GGMLQuantizationType.Q8_0)
        else:
            yield name, int(GGMLQuantizationType.F32), shape, values


def _size_label(vocab_size: int, d: Dims = DIMS) -> str:
    """general.size_label as the converter computes it: experts x (shared + one expert's) parameters."""
    total = expert = 0
    for name, shape, _ in _tensor_shapes(vocab_size, d):
        n = int(np.prod(shape))
        total += n
        if "_exps." in name:
            expert += n // d.n_experts
    shared = total - expert * d.n_experts
    return size_label(total, shared, expert, d.n_experts)


def _metadata(vocab: Vocabulary, d: Dims = DIMS) -> dict[str, object]:
    a = ARCH
    n_blocks = d.n_layers + d.n_mtp_layers
    recurrent = [il < d.n_layers and (il + 1) % d.full_attention_interval != 0 for il in range(n_blocks)]
    return {
        "general.architecture": a,
        "general.type": "model",
        "general.name": DEFAULT_MODEL_NAME,
        "general.finetune": "random-weights",
        "general.basename": "strata-async-default",
        "general.size_label": _size_label(len(vocab.tokens), d),
        f"{a}.block_count": n_blocks,
        f"{a}.context_length": d.context_length,
        f"{a}.embedding_length": d.hidden,
        f"{a}.feed_forward_length": d.dense_ffn,
        f"{a}.attention.head_count": d.n_heads,
        f"{a}.attention.head_count_kv": d.n_kv_heads,
        f"{a}.rope.freq_base": d.rope_theta,
        f"{a}.attention.layer_norm_rms_epsilon": d.rms_eps,
        f"{a}.expert_count": d.n_experts,
        f"{a}.expert_used_count": d.n_experts_used,
        f"{a}.attention.key_length": d.head_dim,
        f"{a}.attention.value_length": d.head_dim,
        "general.file_type": 7,  # LLAMA_FTYPE_MOSTLY_Q8_0
        f"{a}.expert_feed_forward_length": d.expert_ffn,
        f"{a}.expert_shared_feed_forward_length": d.shared_ffn,
        f"{a}.nextn_predict_layers": d.n_mtp_layers,
        f"{a}.ssm.conv_kernel": d.conv_kernel,
        f"{a}.ssm.state_size": d.linear_head_dim,
        f"{a}.ssm.group_count": d.linear_k_heads,
        f"{a}.ssm.time_step_rank": d.linear_v_heads,
        f"{a}.ssm.inner_size": d.linear_head_dim * d.linear_v_heads,
        f"{a}.attention.recurrent_layers": recurrent,
        f"{a}.full_attention_interval": d.full_attention_interval,
        f"{a}.rope.dimension_count": int(d.head_dim * d.partial_rotary_factor),
        "general.quantization_version": 2,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": vocab.tokens,
        "tokenizer.ggml.token_type": vocab.token_types,
        "tokenizer.ggml.merges": vocab.merges,
        "tokenizer.ggml.eos_token_id": vocab.id_of(EOS_TOKEN),
        "tokenizer.ggml.padding_token_id": vocab.id_of(PAD_TOKEN),
        "tokenizer.ggml.bos_token_id": vocab.id_of(BOS_TOKEN),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
        VERSION_KEY: DEFAULT_MODEL_VERSION,
    }
