"""The engine: runs requests on the model in one worker thread, fed and drained from the event loop.

The event loop never computes. It reserves room for a request (`Engine.reserve`, which raises `Overloaded`
at once when the bounded queue is full), turns it into token ids off the loop, and submits it; the worker
thread runs the requests over `parallel` slots, a prefill chunk or a decode step at a time in the order
scheduler.py decides, and hands each request's output back to the loop with `call_soon_threadsafe`.
Commands from the loop (submit, cancel, pause, resume) reach the worker through a thread-safe queue it
drains before every step, so a cancel frees its slot within one step.

Output is bounded per request: a streaming request whose reader has `backlog_tokens` tokens not yet taken
is paused (the scheduler skips it) until they are; one paused for longer than `stall_timeout_s` ends with
a slow_consumer error rather than hold its slot forever.

A request generates exactly as strata_async.generate does (the same sampler, stop strings and end rules),
step by step; the prompt cache lets it start from a snapshot of earlier work.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .generate import StopMatcher
from .model import Model
from .prompt_cache import PromptCache
from .protocol import INTERNAL, SLOW_CONSUMER
from .sampling import Sampler, SamplingParams
from .scheduler import SlotView, WaitingView, admit, next_step
from .tokenizer import StreamDecoder, Tokenizer

__all__ = ["Engine", "EngineConfig", "Job", "NoFIM", "Outcome", "Overloaded", "RequestStream", "Reservation",
           "chat_prompt", "fim_prompt"]

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0  # tokens/s is measured over this many recent seconds


class Overloaded(Exception):
    """The request queue is full; the request was not taken."""


class NoFIM(ValueError):
    """The model has no fill-in-the-middle tokens."""


@dataclass(frozen=True)
class EngineConfig:
    parallel: int = 1  # requests computed at once (slots), interleaved step by step
    max_queue: int = 64  # requests waiting for a slot (and being prepared) beyond the running ones
    cache_bytes: int = 256 << 20  # prompt cache capacity; 0 turns the cache off
    snapshot_interval: int = 256  # a prompt-cache snapshot every this many prompt tokens
    backlog_tokens: int = 256  # unread tokens of a streaming request before it is paused
    stall_timeout_s: float = 60.0  # a request paused this long (its reader gone quiet) is dropped

    def __post_init__(self) -> None:
        for name in ("parallel", "snapshot_interval", "backlog_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_queue < 0 or self.cache_bytes < 0 or not self.stall_timeout_s > 0:
            raise ValueError(f"max_queue and cache_bytes must be >= 0 and stall_timeout_s > 0, got {self.max_queue}, "
                             f"{self.cache_bytes}, {self.stall_timeout_s}")


@dataclass(frozen=True)
class Job:
    """A request ready to run: its prompt as token ids and how to generate."""
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = True  # False: output is handed over once, at the end (never paused)
    use_cache: bool = True
    session: str | None = None
    client: int = 0  # who asked (a connection): slots are shared fairly between clients
    received_at: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Outcome:
    finish_reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_s: float
    prefill_s: float
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    error: tuple[str, str] | None = None  # (code, message) when finish_reason is "error"


# ---- prompts ------------------------------------------------------------------------------------

def chat_prompt(tokenizer: Tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of chat messages rendered with the model's template, ending where the reply begins."""
    return tokenizer.encode(tokenizer.render_chat(list(messages), add_generation_prompt=True))


def fim_prompt(tokenizer: Tokenizer, prefix: str, suffix: str, context: Sequence[tuple[str, str]],
               budget: int) -> list[int]:
    """Token ids of a fill-in-the-middle prompt in at most `budget` tokens, laid out as llama.cpp's server does:

        [FIM_REP]myproject\\n [FIM_SEP]filename\\n chunk ... [FIM_SEP]filename\\n
        [FIM_PRE]prefix[FIM_SUF]suffix[FIM_MID]

    `context` holds (filename, text) chunks of other files; without FIM_REP/FIM_SEP tokens the chunks are
    separated by a "--- snippet ---" line. What does not fit goes first from the front of the context,
    then from the start of the prefix and the end of the suffix (3/4 of the room to the prefix). Code is
    tokenized without parsing control tokens, so text that spells one stays text.
    """
    pre, suf, mid = tokenizer.fim_pre_id, tokenizer.fim_suf_id, tokenizer.fim_mid_id
    if pre is None or suf is None or mid is None:
        raise NoFIM("the model has no fill-in-the-middle tokens (FIM prefix/suffix/middle); use generate instead")

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special=False, parse_special=False)

    extra: list[int] = []
    if tokenizer.fim_rep_id is not None:
        extra += [tokenizer.fim_rep_id, *enc("myproject\n")]
    for filename, text in context:
        extra += [tokenizer.fim_sep_id, *enc(filename + "\n")] if tokenizer.fim_sep_id is not None \
            else enc("\n\n--- snippet ---\n\n")
        extra += enc(text)
    if tokenizer.fim_sep_id is not None:
        extra += [tokenizer.fim_sep_id, *enc("filename\n")]
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    prefix_ids, suffix_ids = enc(prefix), enc(suffix)
    room = budget - len(bos) - 3  # the three FIM tokens
    if room < 1:
        raise ValueError(f"a budget of {budget} tokens leaves no room for an infill prompt")
    if len(prefix_ids) + len(suffix_ids) > room:
        keep_suffix = min(len(suffix_ids), max(room // 4, room - len(prefix_ids)))
        suffix_ids = suffix_ids[:keep_suffix]
        prefix_ids = prefix_ids[len(prefix_ids) - (room - keep_suffix):] if room > keep_suffix else []
    core = [pre, *prefix_ids, suf, *suffix_ids, mid]
    take = min(len(extra), budget - len(bos) - len(core))
    return bos + extra[len(extra) - take:] + core


# ---- the loop's side ----------------------------------------------------------------------------

@dataclass
class EngineStats:
    """Counters for /metrics, updated on the event loop as output arrives."""
    finished: Counter[str] = field(default_factory=Counter)  # requests by finish_reason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) of the last RATE_WINDOW_S

    def count_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.completion_tokens += n
        self.recent.append((now, n))
        self._forget(now)

    def tokens_per_second(self) -> float:
        self._forget(time.monotonic())
        return sum(n for _, n in self.recent) / RATE_WINDOW_S

    def _forget(self, now: float) -> None:
        while self.recent and self.recent[0][0] < now - RATE_WINDOW_S:
            self.recent.popleft()


class RequestStream:
    """One submitted request as the loop sees it: the output not yet taken, and how it ended."""

    def __init__(self, engine: Engine, number: int, job: Job):
        self.number = number
        self.streaming = job.stream
        self.outcome: Outcome | None = None
        self.on_ready: Callable[[], None] | None = None  # called on the loop when there is output to take
        self._engine = engine
        self._text: list[str] = []  # text not yet taken
        self._ids: list[int] = []  # token ids not yet taken
        self._paused = False  # the worker was told to stop computing this request until output is taken

    def take(self) -> tuple[str, list[int], Outcome | None]:
        """Everything produced since the last take (coalesced), and the outcome once it has ended."""
        text, ids = "".join(self._text), self._ids
        self._text, self._ids = [], []
        if self._paused and self.outcome is None:
            self._paused = False
            self._engine._command("resume", self.number)
        return text, ids, self.outcome

    def cancel(self) -> None:
        """Stop the request; it ends with finish_reason "cancelled" (unless it has ended already)."""
        if self.outcome is None:
            self._engine._command("cancel", self.number)

    def _deliver(self, ids: list[int], text: str, outcome: Outcome | None) -> None:
        """Output from the worker (runs on the loop)."""
        self._ids += ids
        if text:
            self._text.append(text)
        self._engine._account(len(ids), outcome)
        if outcome is not None:
            self.outcome = outcome
        elif self.streaming and not self._paused and len(self._ids) >= self._engine.config.backlog_tokens:
            self._paused = True
            self._engine._command("pause", self.number)
        if (self.streaming or outcome is not None) and self.on_ready is not None:
            self.on_ready()


class Reservation:
    """Room for one request in the engine, held while it is being prepared; submit or release it."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._held = True

    def submit(self, job: Job) -> RequestStream:
        if not self._held:
            raise RuntimeError("this reservation was already used or released")
        stream = self._engine._submit(job)
        self._held = False
        return stream

    def release(self) -> None:
        if self._held:
            self._held = False
            self._engine._load -= 1


# ---- the worker's side --------------------------------------------------------------------------

class _Sequence:
    """A request inside the worker: its model state and generation progress (worker thread only)."""

    def __init__(self, number: int, job: Job, stream: RequestStream, tokenizer: Tokenizer):
        self.number = number
        self.job = job
        self.stream = stream
        self.prompt = np.asarray(job.prompt_ids, dtype=np.int64)
        self.sampler = Sampler(job.sampling)
        self.sampler.accept(job.prompt_ids)
        self.decoder = StreamDecoder(tokenizer, skip_special=True)
        self.matcher = StopMatcher(job.stop)
        self.end_ids = frozenset() if job.ignore_eos else tokenizer.eog_ids
        self.state = None  # the model state, from a snapshot or fresh, once admitted
        self.prefilled = 0  # prompt tokens in the state
        self.cached = 0  # of which restored from the prompt cache
        self.generated: list[int] = []  # tokens generated so far
        self.fed_generated = 0  # of which fed back into the state
        self.next_token: int | None = None  # the last generated token, to feed in the next decode step
        self.last_logits: np.ndarray | None = None  # next-token logits at the state's position
        self.admitted = -1  # admission order
        self.last_served = -1  # step number of its last step
        self.paused = False
        self.paused_since = 0.0
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.prefill_compute_s = 0.0
        self.out_ids: list[int] = []  # produced since the last post to the loop
        self.out_text: list[str] = []
        self.outcome: Outcome | None = None

    def view(self) -> SlotView:
        return SlotView(self.number, self.job.client, self.admitted, self.last_served,
                        self.prefilled + self.fed_generated, int(self.prompt.size) - self.prefilled, self.paused)


class Engine:
    """Requests in, token streams out; the model runs in one worker thread that only the engine touches."""

    def __init__(self, model: Model, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        self.runtime = model.runtime
        self.tokenizer = model.tokenizer
        self.cache = PromptCache(config.cache_bytes) if config.cache_bytes > 0 else None
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()  # loop -> worker
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._numbers = itertools.count()  # request numbers, in order of submission
        self._load = 0  # (loop) requests reserved (being prepared), queued or running, not yet ended
        # Worker thread only:
        self._waiting: dict[int, _Sequence] = {}  # by number, in order of arrival
        self._running: dict[int, _Sequence] = {}
        self._steps = 0
        self._admissions = 0

    # -- lifecycle (loop) --

    def warm_up(self) -> None:
        """Run a short prefill and a decode step so that the first request does not wait for kernels to compile."""
        state = self.runtime.new_state()
        n = min(2, self.runtime.max_context - 1)
        if n >= 1:
            self.runtime.forward(state, np.arange(n, dtype=np.int64), all_logits=False)
            self.runtime.forward(state, np.array([0], dtype=np.int64), all_logits=False)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._work, name="strata-async-engine", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stop the worker after its current step; requests still running get no further output."""
        if self._thread is not None:
            self._command("stop", -1)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None

    # -- requests (loop) --

    @property
    def capacity(self) -> int:
        return self.config.parallel + self.config.max_queue

    def reserve(self) -> Reservation:
        """Room for one more request, or Overloaded when running + queued + being prepared reach capacity."""
        if self._load >= self.capacity:
            raise Overloaded(f"the server is busy: {self.config.parallel} requests running and "
                             f"{self.config.max_queue} queued; retry later")
        self._load += 1
        return Reservation(self)

    def _submit(self, job: Job) -> RequestStream:
        number = next(self._numbers)
        stream = RequestStream(self, number, job)
        self._command("submit", _Sequence(number, job, stream, self.tokenizer))
        return stream

    def _command(self, kind: str, arg: object) -> None:
        self._commands.put((kind, arg))

    def _account(self, n_tokens: int, outcome: Outcome | None) -> None:
        if n_tokens:
            self.stats.count_tokens(n_tokens)
        if outcome is not None:
            self._load -= 1
            self.stats.finished[outcome.finish_reason] += 1
            self.stats.prompt_tokens += outcome.prompt_tokens
            self.stats.cached_tokens += outcome.cached_tokens

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        """Requests taken and not running yet: being prepared or waiting for a slot."""
        return max(0, self._load - len(self._running))

    @property
    def paused(self) -> int:
        return sum(s.paused for s in list(self._running.values()))

    # -- the worker thread --

    def _work(self) -> None:
        while True:
            try:
                idle = not self._waiting and all(s.paused for s in self._running.values())
                if not self._drain(block=idle):
                    return
                self._end_stalled()
                self._admit()
                step = next_step([s.view() for s in self._running.values()], self.runtime.prefill_chunk,
                                 self.config.snapshot_interval)
                if step is not None:
                    self._run_step(self._running[step.request], step.n_tokens)
            except Exception as exc:  # a failure outside any one request: end them all, keep serving
                log.error("engine step failed; ending every request", exc_info=exc)
                for seq in [*self._waiting.values(), *self._running.values()]:
                    self._fail(seq, exc)
                    self._post(seq)

    def _drain(self, block: bool) -> bool:
        """Apply the loop's commands (waiting for one when idle); False once told to stop."""
        try:
            # While slots are paused, wake up now and then to notice stalls.
            command = self._commands.get(timeout=0.25 if self._running else None) if block \
                else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = command
            if kind == "stop":
                return False
            if kind == "submit":
                self._waiting[arg.number] = arg
            else:
                self._apply(kind, arg)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, kind: str, number: int) -> None:
        if kind == "cancel":
            seq = self._waiting.get(number) or self._running.get(number)
            if seq is not None:
                self._finish(seq, "cancelled")
                self._post(seq)
            return
        seq = self._running.get(number)
        if seq is None:
            return  # ended meanwhile
        if kind == "pause" and not seq.paused:
            seq.paused, seq.paused_since = True, time.perf_counter()
        elif kind == "resume":
            seq.paused = False

    def _end_stalled(self) -> None:
        now = time.perf_counter()
        for seq in [s for s in self._running.values() if s.paused]:
            if now - seq.paused_since > self.config.stall_timeout_s:
                self._finish(seq, "error", (SLOW_CONSUMER, f"the output was not read for "
                                                           f"{self.config.stall_timeout_s:g} s; request dropped"))
                self._post(seq)

    def _admit(self) -> None:
        free = self.config.parallel - len(self._running)
        if free <= 0 or not self._waiting:
            return
        waiting = [WaitingView(s.number, s.job.client, s.number) for s in self._waiting.values()]
        for number in admit(waiting, [s.view() for s in self._running.values()], free):
            seq = self._waiting.pop(number)
            self._running[number] = seq
            seq.admitted = self._admissions
            self._admissions += 1
            try:
                self._start(seq)
            except Exception as exc:
                self._fail(seq, exc)
            self._post(seq)

    def _start(self, seq: _Sequence) -> None:
        seq.admitted_at = time.perf_counter()
        snap = None
        if self._caching(seq):
            snap = self.cache.lookup(seq.prompt, session=seq.job.session, request=seq.number)
        if snap is None:
            seq.state = self.runtime.new_state()
            return
        seq.state = PromptCache.restore(snap)
        seq.prefilled = seq.cached = snap.length
        seq.last_logits = snap.logits
        if seq.prefilled == seq.prompt.size:  # the whole prompt was cached: its next-token logits too
            self._sample(seq, snap.logits)

    def _run_step(self, seq: _Sequence, n_tokens: int) -> None:
        seq.last_served = self._steps
        self._steps += 1
        try:
            if seq.prefilled < seq.prompt.size:
                self._prefill(seq, n_tokens)
            else:
                self._decode(seq)
        except Exception as exc:
            self._fail(seq, exc)
        self._post(seq)

    def _prefill(self, seq: _Sequence, n_tokens: int) -> None:
        chunk = seq.prompt[seq.prefilled: seq.prefilled + n_tokens]
        started = time.perf_counter()
        logits = self.runtime.forward(seq.state, chunk, all_logits=False)[-1]
        seq.prefill_compute_s += time.perf_counter() - started
        seq.prefilled += chunk.size
        seq.last_logits = logits
        done = seq.prefilled == seq.prompt.size
        if self._caching(seq):
            if done:  # a turn boundary: the end of the prompt
                self.cache.store(seq.prompt, seq.state, logits, session=seq.job.session, request=seq.number)
            elif seq.prefilled % self.config.snapshot_interval == 0:
                self.cache.store(seq.prompt[: seq.prefilled], seq.state, logits)
        if done:
            self._sample(seq, logits)

    def _decode(self, seq: _Sequence) -> None:
        token = np.array([seq.next_token], dtype=np.int64)
        seq.last_logits = self.runtime.forward(seq.state, token, all_logits=False)[-1]
        seq.fed_generated += 1
        self._sample(seq, seq.last_logits)

    def _sample(self, seq: _Sequence, logits: np.ndarray) -> None:
        """Draw the next token and apply the end rules of strata_async.generate."""
        token = seq.sampler.sample(logits)
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
        if token in seq.end_ids:
            self._finish(seq, "stop")
            return
        seq.generated.append(token)
        seq.out_ids.append(token)
        seq.last_token_at = now
        text = seq.matcher.push(seq.decoder.push(token))
        if text:
            seq.out_text.append(text)
        if seq.matcher.stopped:
            self._finish(seq, "stop")
        elif len(seq.generated) >= seq.job.max_tokens or \
                seq.prompt.size + len(seq.generated) >= self.runtime.max_context:
            self._finish(seq, "length")
        else:
            seq.next_token = token

    def _caching(self, seq: _Sequence) -> bool:
        return self.cache is not None and seq.job.use_cache

    def _fail(self, seq: _Sequence, exc: Exception) -> None:
        log.error("request %d failed", seq.number, exc_info=exc)
        if seq.outcome is None:
            self._finish(seq, "error", (INTERNAL, f"{type(exc).__name__}: {exc}"))

    def _finish(self, seq: _Sequence, reason: str, error: tuple[str, str] | None = None) -> None:
        if reason in ("stop", "length") and not seq.matcher.stopped:
            tail = seq.matcher.finish(seq.decoder.flush())
            if tail:
                seq.out_text.append(tail)
        if reason != "error" and self._caching(seq) and seq.fed_generated > 0:  # a turn boundary: the end of a reply
            fed = np.concatenate([seq.prompt, np.asarray(seq.generated[: seq.fed_generated], dtype=np.int64)])
            self.cache.store(fed, seq.state, seq.last_logits, session=seq.job.session, request=seq.number)
        now = time.perf_counter()
        admitted_at = seq.admitted_at if seq.admitted_at is not None else now
        first, last = seq.first_token_at, seq.last_token_at
        computed = seq.prefilled - seq.cached
        n = len(seq.generated)
        seq.outcome = Outcome(
            finish_reason=reason, prompt_tokens=int(seq.prompt.size), completion_tokens=n, cached_tokens=seq.cached,
            queue_s=admitted_at - seq.job.received_at,
            prefill_s=(first if first is not None else now) - admitted_at,
            ttft_s=first - seq.job.received_at if first is not None else 0.0,
            prefill_tok_s=computed / seq.prefill_compute_s if seq.prefill_compute_s > 0 else 0.0,
            decode_tok_s=(n - 1) / (last - first) if n > 1 and first is not None and last > first else 0.0,
            error=error)
        self._running.pop(seq.number, None)
        self._waiting.pop(seq.number, None)
        seq.state = None

    def _post(self, seq: _Sequence) -> None:
        """Hand what the sequence produced to the loop."""
        if not (seq.out_ids or seq.out_text or seq.outcome is not None):
            return
        ids, text = seq.out_ids, "".join(seq.out_text)
        seq.out_ids, seq.out_text = [], []
        try:
            self._loop.call_soon_threadsafe(seq.stream._deliver, ids, text, seq.outcome)
        except RuntimeError:  # the loop has closed: the server is shutting down, nobody is listening
            pass
