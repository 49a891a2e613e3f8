"""The generation loop: prefill the prompt, then decode one token at a time, streaming text as it becomes final.

Generation ends on an end-of-generation token (unless ignore_eos), after max_tokens, when the context is
full, or when the text contains one of the stop strings. Stop strings are matched on the text, not on
tokens: text that could be the beginning of a stop string is held back until it is known not to be, so a
stop string is never emitted, even when it is spelled across several tokens. Control tokens
(<|im_start|> ...) count as generated tokens but render as no text, as in llama.cpp's server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .sampling import Sampler, SamplingParams
from .tokenizer import StreamDecoder, Tokenizer

__all__ = ["GenerationEvent", "StopMatcher", "Timings", "generate"]


class RuntimeLike(Protocol):
    """What generation needs of strata_async.runtime.Runtime."""

    max_context: int

    def new_state(self) -> object: ...

    def forward(self, state: object, token_ids: np.ndarray, all_logits: bool = True) -> np.ndarray: ...


@dataclass(frozen=True)
class Timings:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float  # from the start of generation to the first sampled token
    prefill_s: float  # the prompt's forward pass
    decode_s: float  # the one-token forward passes and their sampling
    prefill_tok_s: float  # prompt tokens per second
    decode_tok_s: float  # decode steps per second (0 when there were none)


@dataclass(frozen=True)
class GenerationEvent:
    """One step of a generation: a token with the text it made final, or (last) the reason generation ended.

    The texts of all events, in order, concatenate to the generated text. The closing event has
    token_id None, the remaining text (if any), finish_reason "stop" or "length", and the timings.
    """

    token_id: int | None
    text: str
    finish_reason: str | None = None
    timings: Timings | None = None


class StopMatcher:
    """Releases streamed text, holding back any tail that could still become a stop string."""

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(stop)
        self.pending = ""  # text received but not released: the longest tail that is a prefix of a stop string
        self.stopped = False

    def push(self, text: str) -> str:
        """Text that is safe to release after receiving `text`; sets `stopped` when a stop string appears."""
        self.pending += text
        if not self.stop:
            released, self.pending = self.pending, ""
            return released
        found = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if found:
            self.stopped = True
            released, self.pending = self.pending[: min(found)], ""
            return released
        hold = self._partial_tail()
        released, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return released

    def finish(self, text: str = "") -> str:
        """The last text: nothing more follows, so a partial stop string is plain text."""
        released = self.push(text)
        if self.stopped:
            return released
        released, self.pending = released + self.pending, ""
        return released

    def _partial_tail(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of some stop string."""
        for n in range(min(len(self.pending), max(map(len, self.stop)) - 1), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0


def generate(
    runtime: RuntimeLike,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
) -> Iterator[GenerationEvent]:
    """Generate from `prompt_ids`, yielding a GenerationEvent per token and a closing one.

    Arguments are checked here, before the first token is asked for.
    """
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if prompt.size == 0:
        raise ValueError("the prompt is empty: give at least one token of prompt text")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if isinstance(stop, str):
        stop = [stop]
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
    if prompt.size >= runtime.max_context:
        raise ValueError(
            f"the prompt has {prompt.size} tokens but the context holds {runtime.max_context}, which leaves no "
            f"room to generate; shorten the prompt or load the model with a larger max_context"
        )
    return _run(runtime, tokenizer, prompt, max_tokens, sampling or SamplingParams(), tuple(stop), ignore_eos)


def _run(runtime: RuntimeLike, tokenizer: Tokenizer, prompt: np.ndarray, max_tokens: int, sampling: SamplingParams,
         stop: tuple[str, ...], ignore_eos: bool) -> Iterator[GenerationEvent]:
    started = time.perf_counter()
    end_ids = frozenset() if ignore_eos else tokenizer.eog_ids
    sampler = Sampler(sampling)
    sampler.accept(prompt.tolist())
    decoder = StreamDecoder(tokenizer, skip_special=True)
    matcher = StopMatcher(stop)

    state = runtime.new_state()
    logits = runtime.forward(state, prompt, all_logits=False)[-1]
    prefill_s = time.perf_counter() - started
    token = sampler.sample(logits)
    ttft_s = time.perf_counter() - started

    generated = decode_steps = 0
    decode_s = 0.0
    finish = "length"
    while True:
        if token in end_ids:
            finish = "stop"
            break
        generated += 1
        text = matcher.push(decoder.push(token))
        yield GenerationEvent(token, text)
        if matcher.stopped:
            finish = "stop"
            break
        if generated >= max_tokens or prompt.size + generated >= runtime.max_context:
            break
        step_started = time.perf_counter()
        logits = runtime.forward(state, np.array([token], dtype=np.int64), all_logits=False)[-1]
        token = sampler.sample(logits)
        decode_s += time.perf_counter() - step_started
        decode_steps += 1

    tail = "" if matcher.stopped else matcher.finish(decoder.flush())
    timings = Timings(
        prompt_tokens=int(prompt.size),
        generated_tokens=generated,
        ttft_s=ttft_s,
        prefill_s=prefill_s,
        decode_s=decode_s,
        prefill_tok_s=prompt.size / prefill_s if prefill_s > 0 else 0.0,
        decode_tok_s=decode_steps / decode_s if decode_s > 0 else 0.0,
    )
    yield GenerationEvent(None, tail, "stop" if matcher.stopped else finish, timings)
