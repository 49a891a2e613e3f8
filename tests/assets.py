"""Shared test assets: llama.cpp's own converter and quantizer, tiny random checkpoints, transformers references.

Every reference here comes from outside the project: the checkpoints are built and run by transformers, the
GGUF files are written by llama.cpp's converter (`convert_hf_to_gguf.py` with its own `gguf-py`) and quantized
by llama.cpp's `llama-quantize`, both taken from the llama-cpp-python source distribution on PyPI.

Everything downloaded or built lands in `cache_dir()`, keyed so that a second run finds it at once. Each build
runs under an exclusive file lock and is renamed into place only when complete, so concurrent pytest processes
neither race nor see half-written files.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CACHE_ENV = "STRATA_ASYNC_TEST_CACHE"


# ---------------------------------------------------------------------------------------------------------------
# Cache and locking
# ---------------------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Root of the test-asset cache: $STRATA_ASYNC_TEST_CACHE, or ~/.cache/strata-async/test-assets."""
    root = os.environ.get(CACHE_ENV)
    path = Path(root) if root else Path.home() / ".cache" / "strata-async" / "test-assets"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _exclusive(name: str) -> Iterator[None]:
    """Hold an exclusive fcntl lock named `name` inside the cache for the duration of the block."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Return `final`, first creating it with `build(partial_path)` if it does not exist yet.

    `build` writes a file or directory at the path it is given; that path is renamed to `final` only after
    `build` returns, so an interrupted build leaves nothing that a later run would mistake for a result.
    """
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(final.name):
        if final.exists():  # another process finished it while this one waited for the lock
            return final
        partial = final.with_name(final.name + ".partial")
        _remove(partial)
        build(partial)
        os.replace(partial, final)
    return final


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _run(cmd: Sequence[str | os.PathLike], what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd`, raising with its full output when it fails."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout ---\n{proc.stdout[-20000:]}\n--- stderr ---\n{proc.stderr[-20000:]}"
        )
    return proc


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp source (from the llama-cpp-python sdist) and its quantizer
# ---------------------------------------------------------------------------------------------------------------


def _llama_cpp_sdist() -> Path:
    """The llama-cpp-python source tarball, downloaded with pip on first use."""
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"

    def download(partial: Path) -> None:
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            _run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp],
                "downloading the llama-cpp-python sdist",
            )
            shutil.move(Path(tmp) / name, partial)

    return _build_once(cache_dir() / "downloads" / name, download)


def llama_cpp_dir() -> Path:
    """llama.cpp's source tree (`vendor/llama.cpp` of the llama-cpp-python sdist), extracted on first use."""
    def extract(partial: Path) -> None:
        with tarfile.open(_llama_cpp_sdist()) as tar:
            tar.extractall(partial, filter="data")

    root = _build_once(cache_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}", extract)
    return root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"


# CPU only, static, portable. -O1 because on two cores it builds in 5-7 minutes where the default -O3 takes ~17,
# and the quantized files come out byte-identical (ggml's quantizers are plain C, no fast-math).
QUANTIZE_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG", "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TOOLS=ON",
)


def llama_quantize_binary() -> Path:
    """llama.cpp's `llama-quantize`, built once from the sdist (only that target, QUANTIZE_CMAKE_FLAGS).

    The build's wall time is kept next to the binary in build_seconds.txt.
    """
    source = llama_cpp_dir()

    def build(partial: Path) -> None:
        with tempfile.TemporaryDirectory(dir=cache_dir()) as build_dir:
            started = time.monotonic()
            _run(["cmake", "-S", source, "-B", build_dir, *QUANTIZE_CMAKE_FLAGS], "configuring llama.cpp with cmake")
            _run(["cmake", "--build", build_dir, "--target", "llama-quantize", "-j", "2"], "building llama-quantize")
            partial.mkdir()
            shutil.copy2(Path(build_dir) / "bin" / "llama-quantize", partial / "llama-quantize")
            (partial / "build_seconds.txt").write_text(f"{time.monotonic() - started:.1f}\n")

    flags_digest = hashlib.sha256(" ".join(QUANTIZE_CMAKE_FLAGS).encode()).hexdigest()[:8]
    build_dir = _build_once(cache_dir() / f"llama-quantize-{LLAMA_CPP_PYTHON_VERSION}-{flags_digest}", build)
    return build_dir / "llama-quantize"


def llama_quantize(src_gguf: Path, dst_gguf: Path, qtype: str, extra_args: Sequence[str] = ()) -> Path:
    """Quantize `src_gguf` to `dst_gguf` with llama.cpp's own `llama-quantize` (`qtype` e.g. "Q4_K_M", "Q8_0";
    `extra_args` e.g. ["--tensor-type", "per_layer_token_embd=iq4_nl"])."""
    dst_gguf = Path(dst_gguf)
    partial = dst_gguf.with_name(dst_gguf.name + ".partial")
    _run([llama_quantize_binary(), *extra_args, src_gguf, partial, qtype, "2"],
         f"llama-quantize {qtype} of {src_gguf}")
    os.replace(partial, dst_gguf)
    return dst_gguf


# ---------------------------------------------------------------------------------------------------------------
# Qwen2 tokenizer files, rebuilt from llama.cpp's vocabulary fixture
# ---------------------------------------------------------------------------------------------------------------

# The pre-tokenizer split pattern of Qwen2/Qwen3 tokenizers (tokenizer.json of any Qwen2+ model).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_VOCAB_SIZE = 151936  # embedding rows of every Qwen2/Qwen3 model: 151,646 tokens padded to a multiple of 128
QWEN_EOS = "<|im_end|>"  # Qwen instruct models end a turn with this; the base models use <|endoftext|>
QWEN_PAD = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ASSET_RECIPE = 2  # bump when the way tokenizer files or checkpoints are made changes, so cached ones are rebuilt


def qwen2_vocab_fixture() -> Path:
    """llama.cpp's Qwen2 vocabulary fixture (a tensor-less GGUF holding the full 151,936-entry vocabulary)."""
    return llama_cpp_dir() / "models" / "ggml-vocab-qwen2.gguf"


def qwen2_tokenizer_dir() -> Path:
    """Directory with a Qwen2 `tokenizer.json` + `tokenizer_config.json` rebuilt from `qwen2_vocab_fixture()`.

    The BPE vocabulary and merges, the three control tokens and the chat template are taken from the fixture;
    normalizer (NFC), pre-tokenizer (regex split + byte level) and decoder are the ones every Qwen2/Qwen3
    tokenizer.json declares. llama.cpp's converter recognises the result as pre-tokenizer "qwen2".
    """
    return _build_once(cache_dir() / "tokenizers" / f"qwen2-r{ASSET_RECIPE}", _write_qwen2_tokenizer)


def _write_qwen2_tokenizer(out_dir: Path) -> None:
    from gguf import GGUFReader, TokenType
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    fields = GGUFReader(qwen2_vocab_fixture()).fields
    tokens: list[str] = fields["tokenizer.ggml.tokens"].contents()
    token_types: list[int] = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(merge.split(" ")) for merge in fields["tokenizer.ggml.merges"].contents()]
    chat_template: str = fields["tokenizer.chat_template"].contents()
    if any(len(pair) != 2 for pair in merges):
        raise ValueError(f"{qwen2_vocab_fixture()}: a merge does not consist of exactly two byte-level pieces")

    # The fixture lists normal tokens first, then the control tokens, then [PAD<i>] fillers up to the embedding size.
    normal = {tok: i for i, (tok, kind) in enumerate(zip(tokens, token_types)) if kind == TokenType.NORMAL}
    control = [(i, tok) for i, (tok, kind) in enumerate(zip(tokens, token_types)) if kind == TokenType.CONTROL]
    if sorted(normal.values()) != list(range(len(normal))) or [i for i, _ in control] != list(
        range(len(normal), len(normal) + len(control))
    ):
        raise ValueError(f"{qwen2_vocab_fixture()}: expected normal tokens first, then control tokens")

    tokenizer = Tokenizer(models.BPE(vocab=normal, merges=merges, dropout=None, unk_token=None,
                                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                     byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    # The ByteLevel post-processor is what tells the converter that no BOS is added (tokenizer.ggml.add_bos_token).
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for _, tok in control])
    for i, tok in control:
        if tokenizer.token_to_id(tok) != i:
            raise ValueError(f"control token {tok!r} got id {tokenizer.token_to_id(tok)}, the fixture says {i}")

    out_dir.mkdir(parents=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": QWEN_EOS,
        "pad_token": QWEN_PAD,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 131072,
        "chat_template": chat_template,
        "added_tokens_decoder": {
            str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, tok in control
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Tiny random checkpoints (transformers, float32 safetensors + the Qwen2 tokenizer files)
# ---------------------------------------------------------------------------------------------------------------

CHECKPOINT_SEED = 1234
INITIALIZER_RANGE = 0.15  # transformers' 0.02 leaves a 64-wide model with near-uniform logits
NORM_WEIGHT_NOISE = 0.2  # norm weights start as constants; jitter them so every norm (and its +1 offset) matters
DT_BIAS_STD = 0.5
PLE_CONV_STD = 0.3
A_RANGE = (0.05, 1.5)  # DeltaNet decay rates A = exp(A_log): slow enough that the state carries over many tokens

# Ids of the control tokens of the Qwen2 vocabulary, as the real Qwen3 configs declare them.
QWEN_BOS_ID = 151643
QWEN_EOS_ID = 151645


def full_attention_every(n_layers: int, interval: int = 4) -> list[str]:
    """Qwen3-Next's layer pattern: every `interval`-th layer is full attention, the others Gated DeltaNet."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]


_COMMON = dict(
    vocab_size=QWEN_VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    initializer_range=INITIALIZER_RANGE,
    bos_token_id=QWEN_BOS_ID,
    eos_token_id=QWEN_EOS_ID,
)

TINY_QWEN3NEXT = dict(
    _COMMON,
    num_hidden_layers=8,
    layer_types=full_attention_every(8),
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    shared_expert_intermediate_size=32,
    intermediate_size=128,
)

TINY_QWEN3MOE = dict(
    _COMMON,
    num_hidden_layers=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    intermediate_size=128,
)

# Qwen3.8-Flash-Next in miniature: DeltaNet x3 + QSA attention, twice; hyper-connections over 4 streams; one PLE
# layer with small prime n-gram tables. Inside what llama.cpp's qwen4exp accepts: one PLE layer, a sigmoid
# DeltaNet output gate, linear key head size = value head size. 16 indexer heads (with few, several blocks score
# exactly 0 and tie at the cut-off) and a budget of 2 blocks of 4: prompts longer than 12 tokens drop blocks.
TINY_QWEN4EXP = dict(
    {k: v for k, v in TINY_QWEN3NEXT.items() if k not in ("decoder_sparse_step", "intermediate_size")},
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    hc_count=4,
    hc_lowrank=16,
    ple_layer_ids=[2],  # one-indexed: the second layer
    ple_embed_dim=64,
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=1000,
    split_ngram_parts=2,
    indexer_n_heads=16,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=8,
    indexer_compress_ratio=4,
    output_gate_type="sigmoid",
)

# Variants whose every quantized row length is a multiple of 256 (the K-quant super-block), so llama-quantize
# applies the requested type everywhere instead of falling back to a legacy type for odd-sized rows.
KQUANT_QWEN3NEXT = dict(
    TINY_QWEN3NEXT,
    hidden_size=256,
    num_hidden_layers=4,
    layer_types=full_attention_every(4),
    head_dim=64,  # attn_output rows: 4 heads x 64
    linear_key_head_dim=64,
    linear_value_head_dim=64,  # ssm_out rows: 4 value heads x 64
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    intermediate_size=256,
)

KQUANT_QWEN3MOE = dict(
    TINY_QWEN3MOE,
    hidden_size=256,
    num_hidden_layers=2,
    head_dim=64,
    moe_intermediate_size=256,
    intermediate_size=256,
)


KQUANT_QWEN4EXP = dict(
    TINY_QWEN4EXP,
    hidden_size=256,
    num_hidden_layers=4,
    layer_types=full_attention_every(4),
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    hc_lowrank=256,  # the row length of hc_*_up
    ple_embed_dim=256,  # the row length of ple_key / ple_value
    ple_layer_ids=[1],
)


def tiny_qwen3next_dir(**overrides) -> Path:
    """A tiny random Qwen3NextForCausalLM checkpoint (8 layers: DeltaNet x3 + attention, twice). See TINY_QWEN3NEXT."""
    return _checkpoint_dir("Qwen3NextForCausalLM", _with_layer_pattern(TINY_QWEN3NEXT, overrides))


def tiny_qwen3moe_dir(**overrides) -> Path:
    """A tiny random Qwen3MoeForCausalLM checkpoint. See TINY_QWEN3MOE."""
    return _checkpoint_dir("Qwen3MoeForCausalLM", {**TINY_QWEN3MOE, **overrides})


def kquant_qwen3next_dir(**overrides) -> Path:
    """A small Qwen3NextForCausalLM checkpoint with K-quant-able (multiple of 256) row lengths."""
    return _checkpoint_dir("Qwen3NextForCausalLM", _with_layer_pattern(KQUANT_QWEN3NEXT, overrides))


def kquant_qwen3moe_dir(**overrides) -> Path:
    """A small Qwen3MoeForCausalLM checkpoint with K-quant-able (multiple of 256) row lengths."""
    return _checkpoint_dir("Qwen3MoeForCausalLM", {**KQUANT_QWEN3MOE, **overrides})


def tiny_qwen4exp_dir(**overrides) -> Path:
    """A tiny random Qwen4ExpForCausalLM checkpoint (8 layers: DeltaNet x3 + QSA attention, twice). See
    TINY_QWEN4EXP."""
    return _checkpoint_dir("Qwen4ExpForCausalLM", _with_layer_pattern(TINY_QWEN4EXP, overrides))


def kquant_qwen4exp_dir(**overrides) -> Path:
    """A small Qwen4ExpForCausalLM checkpoint with K-quant-able (multiple of 256) row lengths."""
    return _checkpoint_dir("Qwen4ExpForCausalLM", _with_layer_pattern(KQUANT_QWEN4EXP, overrides))


CHECKPOINTS: dict[str, Callable[..., Path]] = {
    "qwen3next": tiny_qwen3next_dir,
    "qwen3moe": tiny_qwen3moe_dir,
    "qwen3next_kquant": kquant_qwen3next_dir,
    "qwen3moe_kquant": kquant_qwen3moe_dir,
    "qwen4exp": tiny_qwen4exp_dir,
    "qwen4exp_kquant": kquant_qwen4exp_dir,
}


def checkpoint_dir(model_key: str) -> Path:
    """The default checkpoint of `model_key`, one of CHECKPOINTS' keys."""
    if model_key not in CHECKPOINTS:
        raise KeyError(f"unknown test checkpoint {model_key!r}; known: {', '.join(CHECKPOINTS)}")
    return CHECKPOINTS[model_key]()


def _with_layer_pattern(base: dict, overrides: dict) -> dict:
    config = {**base, **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        config["layer_types"] = full_attention_every(config["num_hidden_layers"])
    return config


def _checkpoint_dir(architecture: str, config: dict) -> Path:
    import torch
    import transformers

    key = json.dumps(
        {"architecture": architecture, "config": config, "recipe": ASSET_RECIPE, "seed": CHECKPOINT_SEED,
         "torch": torch.__version__, "transformers": transformers.__version__},
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return _build_once(cache_dir() / "checkpoints" / f"{architecture}-{digest}",
                       functools.partial(_build_checkpoint, architecture, config))


def _build_checkpoint(architecture: str, config: dict, out_dir: Path) -> None:
    import torch
    import transformers

    model_class = getattr(transformers, architecture)
    torch.manual_seed(CHECKPOINT_SEED)
    model = model_class(model_class.config_class(**config)).to(torch.float32).eval()
    _randomize_constant_parameters(model)
    _check_forward_is_sane(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(qwen2_tokenizer_dir() / name, out_dir / name)


def _randomize_constant_parameters(model) -> None:
    """Draw norm weights, dt_bias and A_log ourselves: transformers starts norms and dt_bias as constants, and its
    A ~ U(0.01, 16) makes some heads forget their state within a token."""
    import torch

    generator = torch.Generator().manual_seed(CHECKPOINT_SEED + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".A_log"):
                a = torch.empty(param.shape).uniform_(*A_RANGE, generator=generator)
                param.copy_(a.log())
            elif name.endswith(".dt_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * DT_BIAS_STD)
            elif "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
                param.add_(torch.randn(param.shape, generator=generator) * NORM_WEIGHT_NOISE)
            elif name.endswith(".ple.conv1d.weight"):  # transformers starts it at zero: the conv would not count
                param.copy_(torch.randn(param.shape, generator=generator) * PLE_CONV_STD)


def _check_forward_is_sane(model) -> None:
    """Refuse a checkpoint whose logits are not finite or too flat to give stable argmaxes."""
    import torch

    generator = torch.Generator().manual_seed(CHECKPOINT_SEED + 2)
    ids = torch.randint(0, QWEN_BOS_ID, (1, 24), generator=generator)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0]
    if not torch.isfinite(logits).all():
        raise RuntimeError("tiny checkpoint produces non-finite logits; lower INITIALIZER_RANGE")
    spread = logits.std(dim=-1).min().item()
    if spread < 0.5:
        raise RuntimeError(f"tiny checkpoint logits are nearly uniform (std {spread:.3f}); raise INITIALIZER_RANGE")


# ---------------------------------------------------------------------------------------------------------------
# Conversion to GGUF with llama.cpp's own converter
# ---------------------------------------------------------------------------------------------------------------


def converter_flags(model_dir: Path) -> list[str]:
    """Flags llama.cpp's converter needs for this checkpoint, besides the output file and type.

    Qwen3-Next checkpoints normally carry a multi-token-prediction block (`mtp.*` tensors); the converter
    asserts on a checkpoint without one unless told `--no-mtp`.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "Qwen3NextForCausalLM" in config.get("architectures", []) and not _has_mtp_tensors(Path(model_dir)):
        return ["--no-mtp"]
    return []


def _has_mtp_tensors(model_dir: Path) -> bool:
    from safetensors import safe_open

    for shard in model_dir.glob("*.safetensors"):
        with safe_open(shard, framework="np") as f:
            if any(name.startswith(("mtp.", "model.mtp.")) for name in f.keys()):
                return True
    return False


def _raw_config_source(model_dir: Path) -> Path:
    """What the converter should read for this checkpoint: the checkpoint itself, or for Qwen4Exp a sibling
    folder holding the checkpoint's files with the config.json the model authors ship.

    llama.cpp's converter reads hyper-parameters through transformers' AutoConfig and falls back to the raw
    config.json only when that fails. A transformers that knows qwen4_exp rewrites layer_types from
    "full_attention" to "indexed_attention"; the qwen4exp converter tests for "full_attention" and would then
    write every compress ratio as 0 (dense attention). So the folder's config.json names the attention layers
    as the released checkpoints do, under a model_type transformers does not know, forcing the fallback.
    """
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "qwen4_exp_text":
        return model_dir
    raw = model_dir.with_name(model_dir.name + "-raw-config")

    def build(partial: Path) -> None:
        partial.mkdir()
        for f in model_dir.iterdir():
            if f.name != "config.json":
                (partial / f.name).symlink_to(f.resolve())
        layer_types = ["full_attention" if t == "indexed_attention" else t for t in config["layer_types"]]
        (partial / "config.json").write_text(json.dumps({**config, "model_type": "qwen4_exp_raw",
                                                         "layer_types": layer_types}))

    return _build_once(raw, build)


def _check_converted(model_dir: Path, gguf_path: Path) -> None:
    """Refuse a qwen4exp file whose attention layers lost their QSA compress ratios (see _raw_config_source)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "qwen4_exp_text" or not config.get("indexer_compress_ratio"):
        return
    from strata_async.io import open_gguf

    with open_gguf(gguf_path) as f:
        ratios = list(f.metadata["qwen4exp.attention.compress_ratios"])
    expected = [config["indexer_compress_ratio"] if t != "linear_attention" else 0 for t in config["layer_types"]]
    if ratios != expected:
        raise RuntimeError(f"{gguf_path}: compress_ratios {ratios}, expected {expected}: the converter read the "
                           "transformers-rewritten layer types")


def convert_to_gguf(model_dir: Path, out_path: Path, outtype: str = "f32", extra_args: Sequence[str] = ()) -> Path:
    """Convert a transformers checkpoint to GGUF with llama.cpp's `convert_hf_to_gguf.py` and its own gguf-py.

    `outtype` is the converter's --outtype (f32, f16, bf16, q8_0, ...); `converter_flags(model_dir)` are added
    automatically. Raises with the converter's output when it fails.
    """
    source = llama_cpp_dir()
    model_dir = Path(model_dir)
    out_path = Path(out_path)
    partial = out_path.with_name(out_path.name + ".partial")
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    env.pop("NO_LOCAL_GGUF", None)
    _run(
        [sys.executable, source / "convert_hf_to_gguf.py", _raw_config_source(model_dir), "--outfile", partial,
         "--outtype", outtype, *converter_flags(model_dir), *extra_args],
        f"llama.cpp's converter on {model_dir}", cwd=source, env=env,
    )
    _check_converted(model_dir, partial)
    os.replace(partial, out_path)
    return out_path


def converted_gguf(model_dir: Path, outtype: str = "f32", extra_args: Sequence[str] = ()) -> Path:
    """`convert_to_gguf` of `model_dir`, cached next to the checkpoint (keyed by type and extra flags)."""
    model_dir = Path(model_dir)
    suffix = "" if not extra_args else "-" + hashlib.sha256(" ".join(extra_args).encode()).hexdigest()[:8]
    out = model_dir.with_name(f"{model_dir.name}-{outtype}{suffix}.gguf")
    return _build_once(out, lambda partial: convert_to_gguf(model_dir, partial, outtype, extra_args))


def quantized_gguf(model_dir: Path, qtype: str, extra_args: Sequence[str] = ()) -> Path:
    """`model_dir` converted to f32 and quantized to `qtype` by llama-quantize, cached next to the checkpoint
    (keyed by type and extra flags)."""
    model_dir = Path(model_dir)
    suffix = "" if not extra_args else "-" + hashlib.sha256(" ".join(extra_args).encode()).hexdigest()[:8]
    out = model_dir.with_name(f"{model_dir.name}-{qtype}{suffix}.gguf")
    return _build_once(out, lambda partial: llama_quantize(converted_gguf(model_dir, "f32"), partial, qtype,
                                                           extra_args))


# ---------------------------------------------------------------------------------------------------------------
# transformers references (CPU; eager attention and eager experts: the plain reference paths)
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: Path):
    """The checkpoint loaded by transformers in float64, eval mode (cached per directory).

    float64 because transformers' own float32 qwen3next result strays up to 1.2e-4 x max |logit| from
    its float64 one on the tiny 8-layer checkpoints (DeltaNet rounding, amplified by random layers),
    more than the differences the parity bar allows most prompts (tests/parity.py). Its gated delta rule still
    runs in float32 inside (the library casts there); the rest of the model is then exact enough to be the
    reference of record.
    """
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        Path(model_dir), dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def hf_reference_logits(model_dir: Path, token_ids: Sequence[int]) -> np.ndarray:
    """Teacher-forced logits of `token_ids` in one forward without a cache: float64 [n, vocab]."""
    import torch

    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))[None]
    with torch.no_grad():
        logits = hf_model(Path(model_dir))(input_ids=ids, use_cache=False).logits[0]
    return logits.numpy()


def hf_greedy(model_dir: Path, prompt_ids: Sequence[int], n_new: int) -> list[int]:
    """`n_new` greedy (argmax) tokens after `prompt_ids`: one prefill, then one cached forward per token.

    No end-of-sequence stop and no logits processors, so exactly `n_new` argmaxes come back.
    """
    return hf_greedy_logits(model_dir, prompt_ids, n_new)[0]


def hf_greedy_logits(model_dir: Path, prompt_ids: Sequence[int], n_new: int) -> tuple[list[int], np.ndarray]:
    """hf_greedy's tokens, and the logits each was the argmax of (n_new x vocab, float64)."""
    import torch

    model = hf_model(Path(model_dir))
    ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64))[None]
    generated: list[int] = []
    rows: list[np.ndarray] = []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(n_new):
            rows.append(out.logits[0, -1].double().numpy())
            generated.append(int(rows[-1].argmax()))
            if len(generated) < n_new:
                out = model(input_ids=torch.tensor([[generated[-1]]]), cache=out.cache, use_cache=True)
    return generated, np.stack(rows)


# ---------------------------------------------------------------------------------------------------------------
# random inputs: a fresh seed every run (tests never run on fixed or zero data)
# ---------------------------------------------------------------------------------------------------------------


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator with a new seed, and the seed (print it in a failure message to replay the case)."""
    seed = int.from_bytes(os.urandom(8), "little")
    return np.random.default_rng(seed), seed


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    """float32 normal samples of the given shape."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)
