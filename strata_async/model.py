"""The public model object: `strata_async.load()` returns a `Model`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from .default_model import default_model_path
from .generate import GenerationEvent, generate
from .runtime import PREFILL_CHUNK, LoadOptions, ModelConfig, Runtime, load_runtime
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__all__ = ["Model", "load"]


def load(path: str | os.PathLike[str] | None = None, *, threads: int | None = None,
         quantized_activations: bool = False, prefill_chunk: int = PREFILL_CHUNK, max_context: int | None = None,
         ple_io: str = "direct", ple_cache_rows: int = 4096, prefault: bool = True,
         load_progress: Callable[[int, int], None] | None = None, keep_freed_buffers: bool = True,
         repack: str = "auto", huge_pages: str = "auto") -> Model:
    """Open a GGUF model for CPU inference.

    path: the .gguf file (any shard of a split model); None loads the embedded default model, a small
    random-weight qwen3next built into the cache directory on first use (its output is meaningless).
    threads: CPU threads for the kernels; quantized_activations: round activations as ggml does before
    quantized dot products; prefill_chunk: prompt tokens per forward step; max_context: the most tokens
    (prompt + generated) a sequence may hold, at most the model's context length (the default).
    ple_io / ple_cache_rows: for a model with an n-gram PLE table (qwen4exp), how its rows are read:
    "direct" (O_DIRECT from the drive: the table never fills RAM or the page cache), "mmap" or "ram"
    (the whole table read into memory at load), and how many recently used rows stay in RAM.
    prefault: map every weight page in at load (reading what the page cache lacks); False leaves each page
    to fault on first use (a faster start, slower first tokens per expert); load_progress(done, total bytes)
    is called as the pages go in (the repacked ones first). keep_freed_buffers: set glibc's malloc to keep the
    buffers each forward step frees mapped for the next (runtime/host_memory.py: prompts ~10% faster); False leaves
    the process's allocator as it is. repack: IQ2_XS matrices repacked at load into a layout whose CPU dots run
    1.5-1.75x as fast, at 1.43x their memory (kernels/quant_planes.py): "auto" where the CPU has AVX-512 VBMI and
    the model, so grown, fits in 80% of the RAM; "always" where the CPU has it; "never". huge_pages: the other
    matrices copied at load into memory on transparent huge pages, where a token's reads take a TLB miss per 2 MiB
    and not per 4 KiB (decode 1.02-1.06x on the 80B-shaped files, bench/bench_huge_pages.py): "auto" where the
    system has them, prefault is on and the model fits in 80% of the RAM; "always"; "never" (the file's mapping).
    """
    is_default = path is None
    path = default_model_path() if path is None else Path(path)
    runtime = load_runtime(path, threads=threads, quantized_activations=quantized_activations,
                           prefill_chunk=prefill_chunk, max_context=max_context,
                           options=LoadOptions(ple_io=ple_io, ple_cache_rows=ple_cache_rows, prefault=prefault,
                                               progress=load_progress, keep_freed_buffers=keep_freed_buffers,
                                               repack=repack, huge_pages=huge_pages))
    try:
        tokenizer = Tokenizer.from_gguf(runtime.gguf)
    except BaseException:
        runtime.close()
        raise
    return Model(runtime, tokenizer, path, is_default)


class Model:
    """A loaded model with its tokenizer. Use `logits` for teacher-forced scoring, `generate` for text."""

    def __init__(self, runtime: Runtime, tokenizer: Tokenizer, path: Path, is_default: bool = False):
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.path = path
        self.is_default = is_default  # the embedded random-weight model

    @property
    def config(self) -> ModelConfig:
        return self.runtime.config

    @property
    def name(self) -> str:
        """general.name of the file, or its file name."""
        return str(self.runtime.gguf.metadata.get("general.name") or self.path.name)

    @property
    def max_context(self) -> int:
        return self.runtime.max_context

    def close(self) -> None:
        self.runtime.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: text is tokenized (control tokens written in it are parsed), ids are checked."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give some text or token ids")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
        if not ids:
            raise ValueError("the prompt is empty: give some text or token ids")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def chat_prompt(self, user_message: str) -> str:
        """One user turn wrapped in the model's chat template, ending where the assistant's reply begins."""
        return self.tokenizer.render_chat([{"role": "user", "content": user_message}], add_generation_prompt=True)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [n, vocab]: the next-token logits after each of `token_ids`, run from a fresh sequence."""
        ids = self.encode(list(token_ids))
        if len(ids) > self.max_context:
            raise ValueError(f"{len(ids)} tokens exceed the context of {self.max_context}; score a shorter "
                             f"sequence or load the model with a larger max_context")
        return self.runtime.forward(self.runtime.new_state(), np.asarray(ids, dtype=np.int64), all_logits=True)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 256, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repetition_penalty: float = 1.0,
                 penalty_last_n: int = 64, seed: int | None = None, stop: Sequence[str] = (),
                 ignore_eos: bool = False) -> Iterator[GenerationEvent]:
        """Generate a continuation of `prompt` (text or token ids), yielding events as tokens come.

        Each event carries a token id and the text it made final; the last one has token_id None, the
        finish_reason ("stop" or "length") and the timings. Sampling options are SamplingParams' (llama.cpp's
        defaults and order: repetition penalty over the last penalty_last_n tokens, top-k, top-p, min-p,
        temperature); temperature 0 is greedy; seed makes sampling reproducible. Generation stops at the
        model's end-of-generation tokens unless ignore_eos, after max_tokens, when the context is full, or
        before any of the `stop` strings (never emitted).
        """
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repetition_penalty=repetition_penalty, penalty_last_n=penalty_last_n, seed=seed)
        return generate(self.runtime, self.tokenizer, self.encode(prompt), max_tokens=max_tokens,
                        sampling=sampling, stop=stop, ignore_eos=ignore_eos)
