"""The wire protocol on its own (no socket, no model): every client op parses into its message, every
malformed frame raises a ProtocolError with the right code, and the server's events encode to the
documented shapes. A randomized frame fuzzer checks that nothing but ProtocolError ever escapes."""

from __future__ import annotations

import json
import random

import orjson
import pytest

from strata_async import protocol as p
from strata_async.protocol import (Cancel, ContextChunk, Detokenize, Generate, Infill, Limits, ProtocolError, Status,
                                   Tokenize, parse_frame)

LIMITS = Limits(max_frame_bytes=4096, max_tokens=512, max_prompt_chars=1000, vocab_size=1000)


def parse(obj, limits=LIMITS):
    return parse_frame(json.dumps(obj), limits)


def error_of(frame, limits=LIMITS) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_frame(frame if isinstance(frame, (str, bytes)) else json.dumps(frame), limits)
    return info.value


# ---- valid frames ---------------------------------------------------------------------------------

def test_generate_as_in_the_spec():
    msg = parse({"op": "generate", "id": "r1", "prompt": "def add(", "max_tokens": 64, "temperature": 0, "seed": 1})
    assert isinstance(msg, Generate)
    assert (msg.id, msg.prompt, msg.messages, msg.session, msg.stream, msg.cache) == \
        ("r1", "def add(", None, None, True, True)
    s = msg.sampling
    assert (s.max_tokens, s.temperature, s.seed, s.stop, s.ignore_eos) == (64, 0.0, 1, (), False)
    assert (s.top_k, s.top_p, s.min_p, s.repetition_penalty) == (40, 0.95, 0.05, 1.0)  # llama.cpp's defaults


def test_generate_every_field():
    rng = random.Random()
    ids = [rng.randrange(1000) for _ in range(rng.randrange(1, 50))]
    msg = parse({"op": "generate", "id": "x", "prompt": ids, "top_k": 7, "top_p": 0.5, "min_p": 0.0,
                 "repetition_penalty": 1.3, "stop": ["\n\n", "END"], "ignore_eos": True, "session": "agent-7",
                 "stream": False, "cache": False})
    assert msg.prompt == tuple(ids)
    assert (msg.session, msg.stream, msg.cache) == ("agent-7", False, False)
    assert msg.sampling.stop == ("\n\n", "END")
    assert (msg.sampling.top_k, msg.sampling.top_p, msg.sampling.min_p, msg.sampling.repetition_penalty) == \
        (7, 0.5, 0.0, 1.3)
    assert parse({"op": "generate", "id": "x", "prompt": "a", "stop": "one"}).sampling.stop == ("one",)


def test_default_max_tokens_respects_the_server_limit():
    assert parse({"op": "generate", "id": "x", "prompt": "a"}).sampling.max_tokens == 256
    small = Limits(max_tokens=100)
    assert parse({"op": "generate", "id": "x", "prompt": "a"}, small).sampling.max_tokens == 100


def test_chat_messages():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    msg = parse({"op": "generate", "id": "c", "messages": msgs})
    assert msg.prompt is None and msg.messages == tuple(msgs)


def test_infill_with_context_chunks():
    msg = parse({"op": "infill", "id": "f", "prefix": "def f(", "suffix": "):\n", "max_tokens": 8,
                 "context": ["import os", {"text": "x = 1", "filename": "a.py"}, {"text": "y"}]})
    assert isinstance(msg, Infill)
    assert (msg.prefix, msg.suffix, msg.sampling.max_tokens) == ("def f(", "):\n", 8)
    assert msg.context == (ContextChunk("import os"), ContextChunk("x = 1", "a.py"), ContextChunk("y"))
    assert parse({"op": "infill", "id": "f", "prefix": ""}).suffix == ""


def test_other_ops():
    assert parse({"op": "cancel", "id": "r1"}) == Cancel("r1")
    assert parse({"op": "tokenize", "id": "t", "text": "hello", "add_special": True}) == Tokenize("t", "hello", True)
    assert parse({"op": "detokenize", "id": "d", "token_ids": [1, 2, 999]}) == Detokenize("d", (1, 2, 999))
    assert parse({"op": "status", "id": "s"}) == Status("s")


# ---- malformed frames -----------------------------------------------------------------------------

@pytest.mark.parametrize("frame, code", [
    (b'{"op": "status", "id": "s"}', p.BINARY_FRAME),
    ("", p.INVALID_JSON),
    ("{", p.INVALID_JSON),
    ("not json", p.INVALID_JSON),
    ("NaN", p.INVALID_JSON),
    ('{"op": "generate", "id": "r", "prompt": "a", "temperature": 1e400}', p.INVALID_JSON),
    ('"\\ud800"', p.INVALID_JSON),  # a lone surrogate
    ("[" * 2000 + "]" * 2000, p.INVALID_JSON),  # nesting deeper than the parser allows
    ("[1, 2]", p.INVALID_JSON),
    ("42", p.INVALID_JSON),
    ("null", p.INVALID_JSON),
    ('"generate"', p.INVALID_JSON),
])
def test_frames_that_are_not_json_objects(frame, code):
    assert error_of(frame).code == code


@pytest.mark.parametrize("obj, code, fragment", [
    ({"id": "r"}, p.BAD_REQUEST, "op"),
    ({"op": 7, "id": "r"}, p.BAD_REQUEST, "op"),
    ({"op": "explode", "id": "r"}, p.UNKNOWN_OP, "explode"),
    ({"op": "status"}, p.BAD_REQUEST, "id"),
    ({"op": "status", "id": 5}, p.BAD_REQUEST, "id"),
    ({"op": "status", "id": ""}, p.BAD_REQUEST, "id"),
    ({"op": "status", "id": "x" * 129}, p.BAD_REQUEST, "id"),
    ({"op": "status", "id": "s", "verbose": True}, p.BAD_REQUEST, "verbose"),
    ({"op": "generate", "id": "r"}, p.BAD_REQUEST, "prompt"),
    ({"op": "generate", "id": "r", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, p.BAD_REQUEST,
     "exactly one"),
    ({"op": "generate", "id": "r", "prompt": ""}, p.BAD_REQUEST, "empty"),
    ({"op": "generate", "id": "r", "prompt": []}, p.BAD_REQUEST, "empty"),
    ({"op": "generate", "id": "r", "prompt": 12}, p.BAD_REQUEST, "prompt"),
    ({"op": "generate", "id": "r", "prompt": [1, "2"]}, p.BAD_REQUEST, "prompt"),
    ({"op": "generate", "id": "r", "prompt": [1, True]}, p.BAD_REQUEST, "prompt"),
    ({"op": "generate", "id": "r", "prompt": [1000]}, p.BAD_REQUEST, "vocabulary"),
    ({"op": "generate", "id": "r", "prompt": [-1]}, p.BAD_REQUEST, "vocabulary"),
    ({"op": "generate", "id": "r", "prompt": "x" * 1001}, p.BAD_REQUEST, "longer"),
    ({"op": "generate", "id": "r", "messages": []}, p.BAD_REQUEST, "messages"),
    ({"op": "generate", "id": "r", "messages": "hi"}, p.BAD_REQUEST, "messages"),
    ({"op": "generate", "id": "r", "messages": [{"role": "user"}]}, p.BAD_REQUEST, "messages[0]"),
    ({"op": "generate", "id": "r", "messages": [{"role": "user", "content": 5}]}, p.BAD_REQUEST, "messages[0]"),
    ({"op": "generate", "id": "r", "messages": [{"role": "u", "content": "a", "x": 1}]}, p.BAD_REQUEST, "only"),
    ({"op": "generate", "id": "r", "messages": [{"role": "u", "content": "a" * 600}] * 2}, p.BAD_REQUEST, "exceed"),
    ({"op": "generate", "id": "r", "prompt": "a", "max_tokens": 0}, p.BAD_REQUEST, "max_tokens"),
    ({"op": "generate", "id": "r", "prompt": "a", "max_tokens": 513}, p.BAD_REQUEST, "max_tokens"),
    ({"op": "generate", "id": "r", "prompt": "a", "max_tokens": 10 ** 30}, p.BAD_REQUEST, "max_tokens"),
    ({"op": "generate", "id": "r", "prompt": "a", "max_tokens": 5.0}, p.BAD_REQUEST, "integer"),
    ({"op": "generate", "id": "r", "prompt": "a", "max_tokens": "5"}, p.BAD_REQUEST, "integer"),
    ({"op": "generate", "id": "r", "prompt": "a", "max_tokens": True}, p.BAD_REQUEST, "integer"),
    ({"op": "generate", "id": "r", "prompt": "a", "temperature": -0.1}, p.BAD_REQUEST, "temperature"),
    ({"op": "generate", "id": "r", "prompt": "a", "temperature": 1e300}, p.BAD_REQUEST, "temperature"),
    ({"op": "generate", "id": "r", "prompt": "a", "temperature": "hot"}, p.BAD_REQUEST, "number"),
    ({"op": "generate", "id": "r", "prompt": "a", "top_p": 0}, p.BAD_REQUEST, "top_p"),
    ({"op": "generate", "id": "r", "prompt": "a", "top_p": 1.5}, p.BAD_REQUEST, "top_p"),
    ({"op": "generate", "id": "r", "prompt": "a", "top_k": -1}, p.BAD_REQUEST, "top_k"),
    ({"op": "generate", "id": "r", "prompt": "a", "min_p": 2}, p.BAD_REQUEST, "min_p"),
    ({"op": "generate", "id": "r", "prompt": "a", "repetition_penalty": 0}, p.BAD_REQUEST, "repetition_penalty"),
    ({"op": "generate", "id": "r", "prompt": "a", "seed": -1}, p.BAD_REQUEST, "seed"),
    ({"op": "generate", "id": "r", "prompt": "a", "seed": 2 ** 63}, p.BAD_REQUEST, "seed"),
    ({"op": "generate", "id": "r", "prompt": "a", "stop": [""]}, p.BAD_REQUEST, "empty"),
    ({"op": "generate", "id": "r", "prompt": "a", "stop": [1]}, p.BAD_REQUEST, "stop"),
    ({"op": "generate", "id": "r", "prompt": "a", "stop": ["s"] * 17}, p.BAD_REQUEST, "stop"),
    ({"op": "generate", "id": "r", "prompt": "a", "stop": ["s" * 257]}, p.BAD_REQUEST, "stop"),
    ({"op": "generate", "id": "r", "prompt": "a", "ignore_eos": 1}, p.BAD_REQUEST, "true or false"),
    ({"op": "generate", "id": "r", "prompt": "a", "stream": "yes"}, p.BAD_REQUEST, "stream"),
    ({"op": "generate", "id": "r", "prompt": "a", "session": 3}, p.BAD_REQUEST, "session"),
    ({"op": "generate", "id": "r", "prompt": "a", "prefix": "b"}, p.BAD_REQUEST, "prefix"),
    ({"op": "infill", "id": "f"}, p.BAD_REQUEST, "prefix"),
    ({"op": "infill", "id": "f", "prefix": "a", "context": "file"}, p.BAD_REQUEST, "context"),
    ({"op": "infill", "id": "f", "prefix": "a", "context": [{"filename": "a.py"}]}, p.BAD_REQUEST, "context[0]"),
    ({"op": "infill", "id": "f", "prefix": "a", "context": [{"text": "t", "lang": "py"}]}, p.BAD_REQUEST,
     "context[0]"),
    ({"op": "infill", "id": "f", "prefix": "a", "context": ["c"] * 65}, p.BAD_REQUEST, "context"),
    ({"op": "infill", "id": "f", "prefix": "a" * 600, "suffix": "b" * 600}, p.BAD_REQUEST, "exceed"),
    ({"op": "infill", "id": "f", "prefix": "a", "session": "s"}, p.BAD_REQUEST, "session"),
    ({"op": "cancel", "id": "r", "prompt": "a"}, p.BAD_REQUEST, "prompt"),
    ({"op": "tokenize", "id": "t"}, p.BAD_REQUEST, "text"),
    ({"op": "tokenize", "id": "t", "text": ["a"]}, p.BAD_REQUEST, "text"),
    ({"op": "detokenize", "id": "d", "token_ids": "1 2"}, p.BAD_REQUEST, "token_ids"),
    ({"op": "detokenize", "id": "d", "token_ids": [1.5]}, p.BAD_REQUEST, "token_ids"),
    ({"op": "detokenize", "id": "d", "token_ids": [10 ** 20]}, p.BAD_REQUEST, "token_ids"),
    ({"op": "detokenize", "id": "d", "token_ids": [5000]}, p.BAD_REQUEST, "vocabulary"),
])
def test_malformed_requests(obj, code, fragment):
    err = error_of(obj)
    assert err.code == code
    assert fragment in err.message


def test_errors_name_the_request_when_they_can():
    assert error_of({"op": "generate", "id": "r9", "prompt": "a", "max_tokens": -3}).request_id == "r9"
    assert error_of({"op": "explode", "id": "r9"}).request_id == "r9"
    assert error_of({"op": "status", "id": 5}).request_id is None
    assert error_of({"op": "status", "id": "x" * 129}).request_id is None
    assert error_of("{").request_id is None


def test_frame_size_limit():
    frame = orjson.dumps({"op": "tokenize", "id": "t", "text": "a" * 900}).decode()
    assert isinstance(parse_frame(frame, Limits(max_frame_bytes=len(frame))), Tokenize)
    assert error_of(frame, Limits(max_frame_bytes=len(frame) - 1)).code == p.BAD_REQUEST


def test_invalid_utf8_error():
    try:
        b"{\xff}".decode()
    except UnicodeDecodeError as exc:
        err = p.invalid_utf8(exc)
    assert err.code == p.INVALID_UTF8 and "byte 1" in err.message


def test_fuzzed_frames_raise_only_protocol_errors():
    """Mutations of valid frames: each parses or raises ProtocolError, never anything else."""
    rng = random.Random()
    valid = [
        {"op": "generate", "id": "r1", "prompt": "def add(", "max_tokens": 64, "temperature": 0, "seed": 1},
        {"op": "generate", "id": "r2", "messages": [{"role": "user", "content": "hi"}], "stop": ["x"]},
        {"op": "infill", "id": "f", "prefix": "a", "suffix": "b", "context": [{"text": "c", "filename": "d"}]},
        {"op": "detokenize", "id": "d", "token_ids": [1, 2, 3]},
        {"op": "cancel", "id": "r1"},
    ]
    junk = [None, True, -1, 0, 2 ** 64, -2 ** 70, 1.5, -1e308, "", "x" * 2000, [], [None], {}, {"a": []},
            "\u0000", "\U0001f600", [2 ** 40], {"role": 1}]
    for _ in range(3000):
        obj = dict(rng.choice(valid))
        for _ in range(rng.randrange(1, 4)):
            key = rng.choice([*obj, "op", "id", "prompt", "max_tokens", "seed", "extra", "messages", "token_ids"])
            if rng.random() < 0.2:
                obj.pop(key, None)
            else:
                obj[key] = rng.choice(junk)
        text = json.dumps(obj)  # the standard library writes integers of any size
        if rng.random() < 0.3:  # cut or corrupt the text itself
            cut = rng.randrange(len(text) + 1)
            text = text[:cut] + rng.choice(["", "}", "\"", "\\", "\x00", "]]"]) + text[cut + 1:]
        try:
            parse_frame(text, LIMITS)
        except ProtocolError as err:
            assert err.code in (p.BAD_REQUEST, p.INVALID_JSON, p.UNKNOWN_OP) and err.message


# ---- events ---------------------------------------------------------------------------------------

def test_event_shapes():
    assert orjson.loads(p.token_event("r1", "a, b", [64, 11, 293])) == \
        {"event": "token", "id": "r1", "text": "a, b", "token_ids": [64, 11, 293]}
    usage, timings = p.Usage(3, 64, 0), p.Timings(0.05, 60.0, 12.0, queue_s=0.01, prefill_s=0.04)
    done = orjson.loads(p.done_event("r1", "length", usage, timings))
    assert done == {"event": "done", "id": "r1", "finish_reason": "length",
                    "usage": {"prompt_tokens": 3, "completion_tokens": 64, "cached_tokens": 0},
                    "timings": {"ttft_s": 0.05, "prefill_tok_s": 60.0, "decode_tok_s": 12.0, "queue_s": 0.01,
                                "prefill_s": 0.04}}
    whole = orjson.loads(p.done_event("r2", "error", usage, timings, text="ab", token_ids=[1, 2],
                                      error=("internal", "boom")))
    assert (whole["text"], whole["token_ids"]) == ("ab", [1, 2])
    assert whole["error"] == {"code": "internal", "message": "boom"}
    assert orjson.loads(p.error_event(None, "bad_request", "no")) == \
        {"event": "error", "id": None, "code": "bad_request", "message": "no"}
    assert orjson.loads(p.result_event("t", "tokenize", token_ids=[1])) == \
        {"event": "result", "id": "t", "op": "tokenize", "token_ids": [1]}
    with pytest.raises(ValueError, match="finish_reason"):
        p.done_event("r", "exploded", usage, timings)
