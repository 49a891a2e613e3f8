"""The strata-async wire protocol, version 1: sans-I/O parsing and encoding of JSON frames.

Nothing here touches a socket or the model: the server feeds frames in and sends what comes out, so
every rule of the protocol is tested on its own.  docs/protocol.md is the user-facing description.

Client -> server (one JSON object per text frame, ``op`` says what it is):
  generate    {"op": "generate", "id": "r1", "prompt": "..." | [ids] | "messages": [...], sampling..., "session": "s"}
  infill      {"op": "infill", "id": "r2", "prefix": "...", "suffix": "...", "context": [...], sampling...}
  cancel      {"op": "cancel", "id": "r1"}
  tokenize    {"op": "tokenize", "id": "t1", "text": "..."}
  detokenize  {"op": "detokenize", "id": "t2", "token_ids": [1, 2]}
  status      {"op": "status", "id": "s1"}
Server -> client: {"event": "token" | "done" | "error" | "result", "id": ..., ...}

A generate or infill the server accepts ends with exactly one "done"; any request it refuses gets exactly
one "error" instead (and nothing else). tokenize, detokenize and status answer with one "result".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Union

import orjson

PROTOCOL_VERSION = 1

# Error codes a client can rely on.
BAD_REQUEST = "bad_request"          # well-formed JSON that breaks a rule of the protocol
INVALID_JSON = "invalid_json"        # not JSON, or not a JSON object
INVALID_UTF8 = "invalid_utf8"        # a text frame whose bytes are not UTF-8
BINARY_FRAME = "binary_frame"        # the protocol is text frames only
UNKNOWN_OP = "unknown_op"
DUPLICATE_ID = "duplicate_id"        # an id already in flight on this connection
UNKNOWN_ID = "unknown_id"            # cancel of an id that is not in flight
OVERLOADED = "overloaded"            # the request queue (or this connection's share of it) is full: retry later
CONTEXT_EXCEEDED = "context_exceeded"  # the prompt leaves no room to generate in the model's context
NO_FIM = "no_fim"                    # infill on a model without fill-in-the-middle tokens
NO_TEMPLATE = "no_template"          # chat messages on a model without a chat template
SLOW_CONSUMER = "slow_consumer"      # the client stopped reading a stream for too long; the request was dropped
INTERNAL = "internal"                # a failure inside the server (the message says what); the server goes on

FINISH_REASONS = ("stop", "length", "cancelled", "error")

MAX_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_CONTEXT_CHUNKS = 64
MAX_FILENAME_CHARS = 1024


class ProtocolError(Exception):
    """A frame the server answers with an error event (the connection stays open)."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class Generate:
    id: str
    sampling: Sampling
    prompt: str | tuple[int, ...] | None = None  # text, or token ids used as they are
    messages: tuple[dict, ...] | None = None  # chat messages, rendered with the model's template
    session: str | None = None  # names a conversation, so the prompt cache keeps only its latest turn
    stream: bool = True  # False: no token events, the done event carries the whole text and token ids
    cache: bool = True  # False: neither reuse nor store prompt-cache snapshots (e.g. to measure without them)


@dataclass(frozen=True)
class ContextChunk:
    """Extra text an infill sees before the prefix: another file of the project, a snippet."""
    text: str
    filename: str = "tmp"


@dataclass(frozen=True)
class Infill:
    id: str
    sampling: Sampling
    prefix: str
    suffix: str
    context: tuple[ContextChunk, ...] = ()
    stream: bool = True
    cache: bool = True


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Tokenize:
    id: str
    text: str
    add_special: bool = False


@dataclass(frozen=True)
class Detokenize:
    id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Status:
    id: str


ClientMessage = Union[Generate, Infill, Cancel, Tokenize, Detokenize, Status]


@dataclass(frozen=True)
class Limits:
    """Per-request bounds, set by the server from the model and its options."""
    max_frame_bytes: int = 1 << 20
    max_tokens: int = 4096
    max_prompt_chars: int = 1 << 20
    vocab_size: int = 1 << 31


def parse_frame(frame: str | bytes, limits: Limits = Limits()) -> ClientMessage:
    """Parse and validate one client frame (str: a text frame, bytes: a binary one); raise ProtocolError."""
    if isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(BINARY_FRAME, "binary frames are not part of the protocol: send JSON text frames")
    if len(frame) > limits.max_frame_bytes:  # characters <= bytes, so this never refuses a frame within the limit
        raise ProtocolError(BAD_REQUEST, f"frame of {len(frame)} characters exceeds the limit of "
                                         f"{limits.max_frame_bytes} bytes")
    try:
        obj = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(INVALID_JSON, f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(INVALID_JSON, "a frame must be a JSON object with an \"op\" field")
    rid = obj.get("id")
    request_id = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS else None
    try:
        return _parse_object(obj, limits)
    except ProtocolError as err:
        err.request_id = request_id
        raise


def invalid_utf8(exc: UnicodeDecodeError) -> ProtocolError:
    """The error for a text frame whose bytes are not UTF-8 (the transport decodes text frames)."""
    return ProtocolError(INVALID_UTF8, f"text frame is not valid UTF-8 ({exc.reason} at byte {exc.start})")


def _parse_object(obj: dict, limits: Limits) -> ClientMessage:
    op = obj.get("op")
    if not isinstance(op, str):
        raise ProtocolError(BAD_REQUEST, f"missing \"op\" (one of {', '.join(_PARSERS)})")
    parser = _PARSERS.get(op)
    if parser is None:
        raise ProtocolError(UNKNOWN_OP, f"unknown op {op[:64]!r}: expected one of {', '.join(_PARSERS)}")
    fields = _Fields(obj, allowed=_ALLOWED[op])
    fields.check_no_extra()
    return parser(fields, limits)


class _Fields:
    """Typed access to a frame's fields, with errors that name the field."""

    def __init__(self, obj: dict, allowed: frozenset[str]):
        self.obj = obj
        self.allowed = allowed | {"op", "id"}

    def check_no_extra(self) -> None:
        extra = sorted(set(self.obj) - self.allowed)
        if extra:
            shown = ", ".join(repr(k[:64]) for k in extra[:8])
            raise ProtocolError(BAD_REQUEST, f"unknown field(s) {shown}; allowed: {', '.join(sorted(self.allowed))}")

    def id(self) -> str:
        rid = self.obj.get("id")
        if not isinstance(rid, str) or not rid:
            raise ProtocolError(BAD_REQUEST, "\"id\" must be a non-empty string naming the request")
        if len(rid) > MAX_ID_CHARS:
            raise ProtocolError(BAD_REQUEST, f"\"id\" is longer than {MAX_ID_CHARS} characters")
        return rid

    def string(self, name: str, *, required: bool = True, max_chars: int = 1 << 20) -> str | None:
        v = self.obj.get(name)
        if v is None:
            if required:
                raise ProtocolError(BAD_REQUEST, f"\"{name}\" is required (a string)")
            return None
        if not isinstance(v, str):
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" must be a string, got {_json_type(v)}")
        if len(v) > max_chars:
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" is longer than {max_chars} characters")
        return v

    def integer(self, name: str, default: int | None, lo: int, hi: int) -> int | None:
        v = self.obj.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" must be an integer, got {_json_type(v)}")
        if not lo <= v <= hi:
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" must be between {lo} and {hi}, got {v}")
        return v

    def number(self, name: str, default: float, lo: float, hi: float) -> float:
        v = self.obj.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" must be a number, got {_json_type(v)}")
        if not lo <= v <= hi:  # also rejects NaN
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" must be between {lo} and {hi}, got {v}")
        return float(v)

    def boolean(self, name: str, default: bool) -> bool:
        v = self.obj.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" must be true or false, got {_json_type(v)}")
        return v

    def string_list(self, name: str, max_items: int, max_chars: int) -> tuple[str, ...]:
        v = self.obj.get(name)
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" must be a string or a list of strings")
        if len(v) > max_items:
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" holds more than {max_items} strings")
        if any(len(s) > max_chars for s in v):
            raise ProtocolError(BAD_REQUEST, f"each of \"{name}\" must be at most {max_chars} characters")
        return tuple(v)

    def token_ids(self, name: str, max_items: int, vocab_size: int) -> tuple[int, ...]:
        ids = self.obj.get(name)
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" must be a list of integer token ids")
        if len(ids) > max_items:
            raise ProtocolError(BAD_REQUEST, f"\"{name}\" holds more than {max_items} token ids")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ProtocolError(BAD_REQUEST, f"token id {bad} in \"{name}\" is outside the vocabulary "
                                             f"(0..{vocab_size - 1})")
        return tuple(ids)


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


_SAMPLING_FIELDS = frozenset({"max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed",
                              "stop", "ignore_eos", "stream", "cache"})


def _sampling(f: _Fields, limits: Limits) -> Sampling:
    d = Sampling()
    stop = f.string_list("stop", MAX_STOP_STRINGS, MAX_STOP_CHARS)
    if any(s == "" for s in stop):
        raise ProtocolError(BAD_REQUEST, "stop strings must not be empty")
    top_p = f.number("top_p", d.top_p, 0.0, 1.0)
    if top_p == 0.0:
        raise ProtocolError(BAD_REQUEST, "\"top_p\" must be above 0 (1 = off)")
    return Sampling(
        max_tokens=f.integer("max_tokens", min(d.max_tokens, limits.max_tokens), 1, limits.max_tokens),
        temperature=f.number("temperature", d.temperature, 0.0, 100.0),
        top_k=f.integer("top_k", d.top_k, 0, limits.vocab_size),
        top_p=top_p,
        min_p=f.number("min_p", d.min_p, 0.0, 1.0),
        repetition_penalty=f.number("repetition_penalty", d.repetition_penalty, 0.01, 100.0),
        seed=f.integer("seed", None, 0, 2**63 - 1),
        stop=stop,
        ignore_eos=f.boolean("ignore_eos", False),
    )


def _messages(f: _Fields) -> tuple[dict, ...]:
    v = f.obj.get("messages")
    if not isinstance(v, list) or not v:
        raise ProtocolError(BAD_REQUEST, "\"messages\" must be a non-empty list of {\"role\", \"content\"} objects")
    if len(v) > MAX_MESSAGES:
        raise ProtocolError(BAD_REQUEST, f"\"messages\" holds more than {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(v):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ProtocolError(BAD_REQUEST, f"messages[{i}] must be an object with string \"role\" and \"content\"")
        if set(m) - {"role", "content"}:
            raise ProtocolError(BAD_REQUEST, f"messages[{i}] may hold only \"role\" and \"content\"")
        if len(m["role"]) > MAX_ID_CHARS:
            raise ProtocolError(BAD_REQUEST, f"messages[{i}].role is longer than {MAX_ID_CHARS} characters")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def _parse_generate(f: _Fields, limits: Limits) -> Generate:
    rid = f.id()
    has_prompt, has_messages = "prompt" in f.obj, "messages" in f.obj
    if has_prompt == has_messages:
        raise ProtocolError(BAD_REQUEST, "generate takes exactly one of \"prompt\" (a string or a list of token "
                                         "ids) or \"messages\" (chat)")
    prompt: str | tuple[int, ...] | None = None
    if has_prompt:
        if isinstance(f.obj["prompt"], list):
            prompt = f.token_ids("prompt", limits.max_prompt_chars, limits.vocab_size)
        else:
            prompt = f.string("prompt", max_chars=limits.max_prompt_chars)
        if not prompt:
            raise ProtocolError(BAD_REQUEST, "\"prompt\" is empty: give at least one character or token id")
    messages = _messages(f) if has_messages else None
    if messages and sum(len(m["content"]) for m in messages) > limits.max_prompt_chars:
        raise ProtocolError(BAD_REQUEST, f"messages exceed {limits.max_prompt_chars} characters")
    session = f.string("session", required=False, max_chars=MAX_ID_CHARS)
    return Generate(rid, _sampling(f, limits), prompt=prompt, messages=messages, session=session,
                    stream=f.boolean("stream", True), cache=f.boolean("cache", True))


def _context_chunks(f: _Fields, limits: Limits) -> tuple[ContextChunk, ...]:
    v = f.obj.get("context")
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ProtocolError(BAD_REQUEST, "\"context\" must be a list of strings or {\"text\", \"filename\"} objects")
    if len(v) > MAX_CONTEXT_CHUNKS:
        raise ProtocolError(BAD_REQUEST, f"\"context\" holds more than {MAX_CONTEXT_CHUNKS} chunks")
    chunks = []
    for i, c in enumerate(v):
        if isinstance(c, str):
            chunks.append(ContextChunk(c))
            continue
        if not (isinstance(c, dict) and isinstance(c.get("text"), str) and not set(c) - {"text", "filename"}
                and isinstance(c.get("filename", ""), str)):
            raise ProtocolError(BAD_REQUEST, f"context[{i}] must be a string or an object with string \"text\" "
                                             "and optional string \"filename\"")
        if len(c.get("filename", "")) > MAX_FILENAME_CHARS:
            raise ProtocolError(BAD_REQUEST, f"context[{i}].filename is longer than {MAX_FILENAME_CHARS} characters")
        chunks.append(ContextChunk(c["text"], c.get("filename") or "tmp"))
    return tuple(chunks)


def _parse_infill(f: _Fields, limits: Limits) -> Infill:
    rid = f.id()
    prefix = f.string("prefix", max_chars=limits.max_prompt_chars)
    suffix = f.string("suffix", required=False, max_chars=limits.max_prompt_chars) or ""
    context = _context_chunks(f, limits)
    if len(prefix) + len(suffix) + sum(len(c.text) + len(c.filename) for c in context) > limits.max_prompt_chars:
        raise ProtocolError(BAD_REQUEST, f"prefix, suffix and context exceed {limits.max_prompt_chars} characters")
    return Infill(rid, _sampling(f, limits), prefix=prefix, suffix=suffix, context=context,
                  stream=f.boolean("stream", True), cache=f.boolean("cache", True))


def _parse_tokenize(f: _Fields, limits: Limits) -> Tokenize:
    return Tokenize(f.id(), f.string("text", max_chars=limits.max_prompt_chars), f.boolean("add_special", False))


def _parse_detokenize(f: _Fields, limits: Limits) -> Detokenize:
    return Detokenize(f.id(), f.token_ids("token_ids", limits.max_prompt_chars, limits.vocab_size))


_PARSERS = {
    "generate": _parse_generate,
    "infill": _parse_infill,
    "cancel": lambda f, limits: Cancel(f.id()),
    "tokenize": _parse_tokenize,
    "detokenize": _parse_detokenize,
    "status": lambda f, limits: Status(f.id()),
}
_ALLOWED = {
    "generate": _SAMPLING_FIELDS | {"prompt", "messages", "session"},
    "infill": _SAMPLING_FIELDS | {"prefix", "suffix", "context"},
    "cancel": frozenset(),
    "tokenize": frozenset({"text", "add_special"}),
    "detokenize": frozenset({"token_ids"}),
    "status": frozenset(),
}


# ---- server events ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens taken from the prompt cache instead of being computed


@dataclass(frozen=True)
class Timings:
    ttft_s: float  # from the request's arrival (queueing included) to its first token
    prefill_tok_s: float  # prompt tokens computed (not cached) per second of prefill
    decode_tok_s: float  # tokens per second after the first one, as the client received them
    queue_s: float = 0.0  # waiting for a free slot
    prefill_s: float = 0.0  # from getting a slot to the first token


def token_event(request_id: str, text: str, token_ids: list[int]) -> bytes:
    """Text that became final and the token ids that produced it (either may be empty, never both)."""
    return orjson.dumps({"event": "token", "id": request_id, "text": text, "token_ids": token_ids})


def done_event(request_id: str, finish_reason: str, usage: Usage, timings: Timings, *,
               text: str | None = None, token_ids: list[int] | None = None,
               error: tuple[str, str] | None = None) -> bytes:
    """The end of a generate/infill. text and token_ids are the whole output of a non-streamed request;
    error (code, message) says what went wrong when finish_reason is "error"."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    event: dict[str, Any] = {"event": "done", "id": request_id, "finish_reason": finish_reason,
                             "usage": asdict(usage), "timings": asdict(timings)}
    if text is not None:
        event["text"] = text
        event["token_ids"] = token_ids or []
    if error is not None:
        event["error"] = {"code": error[0], "message": error[1]}
    return orjson.dumps(event)


def error_event(request_id: str | None, code: str, message: str) -> bytes:
    return orjson.dumps({"event": "error", "id": request_id, "code": code, "message": message})


def result_event(request_id: str, op: str, **payload: Any) -> bytes:
    return orjson.dumps({"event": "result", "id": request_id, "op": op, **payload})
