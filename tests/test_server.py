"""The WebSocket server end to end: a real `strata-async serve` process on 127.0.0.1 with the default model,
real WebSocket clients. References: the library's own `Model.generate` (a separate generation loop) run in
this process on the same model file.

Covered: streamed text == non-streamed text == the library's; seeded sampling reproducible; stop strings;
cancel mid-stream frees the slot for a queued request; a disconnect cancels; 16 concurrent clients; overload
errors at the connection and queue bounds; follow-up turns reuse the prompt cache (cached_tokens) and yield
the same tokens as without it; auth; /health and /metrics; a wire fuzz of malformed frames after which the
server still serves an unrelated request untouched; a client that stops reading leaves server memory bounded;
the `complete` and `chat` commands. In process: /health 503 while loading, infill with a model that names its FIM tokens, and the engine's
pause / slow-consumer rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import orjson
from gguf.constants import Keys
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

import strata_async
from strata_async import protocol
from strata_async.client import Client, TokenEvent
from strata_async.engine import Engine, EngineConfig, Job, NoFIM, fim_prompt
from strata_async.sampling import SamplingParams
from strata_async.server import Server, ServerConfig
from strata_async.tokenizer import Tokenizer

API_KEY = secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PARALLEL, MAX_QUEUE, PER_CONNECTION = 4, 28, 24
SERVER_ARGS = ["--port", "0", "--parallel", str(PARALLEL), "--max-queue", str(MAX_QUEUE),
               "--max-requests-per-connection", str(PER_CONNECTION), "--snapshot-interval", "16",
               "--cache-mib", "64", "--backlog-tokens", "16"]
PROMPT = "def add(a, b):"


@dataclass
class RunningServer:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def http(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024

    def alive(self) -> bool:
        return self.process.poll() is None


@contextlib.contextmanager
def start_server(log, *args: str):
    """`strata-async serve` in a subprocess on a free port; yields a RunningServer once /health answers ok."""
    env = {**os.environ, "STRATA_ASYNC_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "strata_async.cli", "serve", *args],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            found = re.search(r"listening on ws://127\.0\.0\.1:(\d+)", log.read_text())
            port = int(found.group(1)) if found else time.sleep(0.1)
        handle = RunningServer(process, port, log)
        while handle.http("/health")[0] != 200:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield handle
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start_server(tmp_path_factory.mktemp("server") / "server.log", *SERVER_ARGS) as handle:
        yield handle


@pytest.fixture(scope="module")
def model():
    m = strata_async.load()
    yield m
    m.close()


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def reference(model, prompt, **kwargs) -> tuple[str, list[int], str]:
    """Text, token ids and finish reason from the library's own generation loop."""
    events = list(model.generate(prompt, **kwargs))
    return "".join(e.text for e in events), [e.token_id for e in events[:-1]], events[-1].finish_reason


async def wait_idle(url: str, timeout: float = 20) -> dict:
    """Wait until the server runs and queues nothing (so one test's leftovers do not skew the next)."""
    async with await Client.connect(url, api_key=API_KEY) as client:
        deadline = time.monotonic() + timeout
        while True:
            status = await client.status()
            if status["running"] == 0 and status["queued"] == 0:
                return status
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.05)


async def raw(url: str, **options):
    return await connect(url, additional_headers=AUTH, compression=None, **options)


# ---- generation ------------------------------------------------------------------------------------

def test_streamed_text_equals_non_streamed_and_library(server, model):
    expected = reference(model, PROMPT, max_tokens=24, temperature=0, ignore_eos=True)

    async def scenario():
        async with await Client.connect(server.url, api_key=API_KEY) as client:
            streamed = await client.complete(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
            whole = await client.complete(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stream=False)
            return streamed, whole

    streamed, whole = run(scenario())
    assert (streamed.text, streamed.token_ids, streamed.finish_reason) == expected
    assert (whole.text, whole.token_ids, whole.finish_reason) == expected
    assert whole.token_frames == 0 and streamed.token_frames >= 1
    assert streamed.usage == {"prompt_tokens": len(model.encode(PROMPT)), "completion_tokens": 24,
                              "cached_tokens": 0}
    assert set(streamed.timings) >= {"ttft_s", "prefill_tok_s", "decode_tok_s"}
    assert streamed.timings["ttft_s"] > 0 and streamed.timings["decode_tok_s"] > 0


def test_seeded_sampling_is_reproducible(server, model):
    params = dict(max_tokens=20, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
    expected = reference(model, PROMPT, seed=42, **params)

    async def one(seed):
        async with await Client.connect(server.url, api_key=API_KEY) as client:
            return await client.complete(PROMPT, seed=seed, cache=False, **params)

    async def scenario():
        return await asyncio.gather(one(42), one(42), one(43))

    a, b, c = run(scenario())
    assert a.token_ids == b.token_ids == expected[1]
    assert a.text == expected[0]
    assert c.token_ids != a.token_ids  # another seed, other draws (20 draws over the whole vocabulary)


def test_stop_strings_match_the_library(server, model):
    text, _, _ = reference(model, PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    stop = text[8:11]
    expected = reference(model, PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])

    async def scenario():
        async with await Client.connect(server.url, api_key=API_KEY) as client:
            return await client.complete(PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])

    got = run(scenario())
    assert (got.text, got.token_ids, got.finish_reason) == expected
    assert got.finish_reason == "stop" and stop not in got.text


def test_follow_up_turn_reuses_the_prompt_cache(server, model):
    """An agent loop: turn 2 = turn 1's prompt + its reply + new text. The server restores the state at the
    end of turn 1 (prompt + every reply token but the last, which was never fed) and computes only the
    rest; the tokens are those of the same request without the cache, and of the library."""
    rng = random.Random()
    prompt1 = model.encode(f"Plan step {rng.randrange(10 ** 6)}: open the file, read it, then")
    params = dict(max_tokens=12, temperature=0, ignore_eos=True)

    async def scenario():
        async with await Client.connect(server.url, api_key=API_KEY) as client:
            turn1 = await client.complete(prompt1, session="agent", **params)
            prompt2 = prompt1 + turn1.token_ids + model.encode(" Next, write the tests.")
            cached = await client.complete(prompt2, session="agent", **params)
            uncached = await client.complete(prompt2, cache=False, **params)
            again = await client.complete(prompt2, session="agent", **params)
            sampled = [await client.complete(prompt2, seed=7, temperature=0.8, max_tokens=12, ignore_eos=True,
                                             cache=use) for use in (True, False)]
            return turn1, prompt2, cached, uncached, again, sampled

    turn1, prompt2, cached, uncached, again, sampled = run(scenario())
    assert turn1.usage["cached_tokens"] == 0
    assert cached.usage["cached_tokens"] == len(prompt1) + len(turn1.token_ids) - 1
    assert uncached.usage["cached_tokens"] == 0
    assert cached.token_ids == uncached.token_ids == reference(model, prompt2, **params)[1]
    assert again.usage["cached_tokens"] == len(prompt2)  # the whole prompt, its next-token logits included
    assert again.token_ids == cached.token_ids
    assert sampled[0].usage["cached_tokens"] == len(prompt2) and sampled[1].usage["cached_tokens"] == 0
    assert sampled[0].token_ids == sampled[1].token_ids


def test_chat_follow_up_reports_cached_tokens(server, model):
    system = "You are a careful assistant. Answer in one short sentence and never use lists. " * 2
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Name a prime number."}]
    params = dict(max_tokens=8, temperature=0, ignore_eos=True)

    async def scenario():
        async with await Client.connect(server.url, api_key=API_KEY) as client:
            reply = await client.generate(messages=first, session="chat", **params).collect()
            second = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Another?"}]
            cached = await client.generate(messages=second, session="chat", **params).collect()
            uncached = await client.generate(messages=second, cache=False, **params).collect()
            return second, cached, uncached

    second, cached, uncached = run(scenario())
    n_prompt = len(model.encode(model.tokenizer.render_chat(second)))
    assert cached.usage["prompt_tokens"] == uncached.usage["prompt_tokens"] == n_prompt
    assert 32 <= cached.usage["cached_tokens"] < n_prompt and uncached.usage["cached_tokens"] == 0
    assert cached.token_ids == uncached.token_ids


def test_sixteen_concurrent_clients(server, model):
    prompts = [f"client {i}: def f{i}(x):" for i in range(16)]
    expected = [reference(model, p, max_tokens=6, temperature=0, ignore_eos=True)[1] for p in prompts]

    async def one(prompt):
        async with await Client.connect(server.url, api_key=API_KEY) as client:
            return await client.complete(prompt, max_tokens=6, temperature=0, ignore_eos=True, cache=False)

    async def scenario():
        await wait_idle(server.url)
        return await asyncio.gather(*(one(p) for p in prompts))

    results = run(scenario(), timeout=90)
    assert [r.finish_reason for r in results] == ["length"] * 16
    assert [r.token_ids for r in results] == expected


# ---- cancel, disconnect, overload -----------------------------------------------------------------

def test_cancel_frees_the_slot_for_a_queued_request(server):
    async def scenario():
        await wait_idle(server.url)
        async with await Client.connect(server.url, api_key=API_KEY) as client:
            long = [client.generate(PROMPT, max_tokens=3000, temperature=0, ignore_eos=True) for _ in range(PARALLEL)]
            for stream in long:
                assert isinstance(await anext(stream), TokenEvent)  # every slot is taken
            queued = await client.generate("queued: ", max_tokens=4, temperature=0, ignore_eos=True).start()
            first = asyncio.ensure_future(anext(queued))
            await asyncio.sleep(0.3)
            assert not first.done()  # no slot for it yet
            cancelled_at = time.monotonic()
            await long[0].cancel()
            async for event in long[0]:
                pass
            done_after = time.monotonic() - cancelled_at
            await first
            started_after = time.monotonic() - cancelled_at
            rest = await queued.collect()
            for stream in long[1:]:
                await stream.cancel()
                async for last in stream:
                    pass
                assert last.finish_reason == "cancelled"
            return event, done_after, started_after, rest

    done, done_after, started_after, rest = run(scenario())
    assert done.finish_reason == "cancelled" and 1 <= done.usage["completion_tokens"] < 3000
    assert done_after < 2.0 and started_after < 3.0
    assert rest.finish_reason == "length"
    run(wait_idle(server.url))


def test_disconnect_cancels_the_connections_requests(server):
    def cancelled_count() -> float:
        text = server.http("/metrics", AUTH)[1].decode()
        return float(re.search(r'strata_async_requests_total\{finish_reason="cancelled"\} (\S+)', text).group(1))

    before = cancelled_count()

    async def scenario():
        ws = await raw(server.url)
        for i in range(3):
            await ws.send(json.dumps({"op": "generate", "id": f"g{i}", "prompt": PROMPT, "max_tokens": 3000,
                                      "ignore_eos": True}))
        assert orjson.loads(await ws.recv())["event"] == "token"
        ws.transport.abort()  # no closing handshake: the client just vanishes
        return await wait_idle(server.url, timeout=10)

    status = run(scenario())
    assert status["running"] == 0
    assert cancelled_count() == before + 3


def test_overload_errors_at_the_connection_and_queue_bounds(server):
    capacity = PARALLEL + MAX_QUEUE

    async def flood(ws, prefix: str, n: int) -> tuple[list[str], list[dict]]:
        for i in range(n):
            await ws.send(json.dumps({"op": "generate", "id": f"{prefix}{i}", "prompt": PROMPT, "max_tokens": 2000,
                                      "temperature": 0, "ignore_eos": True}))
        await ws.send(json.dumps({"op": "status", "id": "st"}))
        errors = []
        while True:  # frames are answered in order: every refusal comes before the status result
            event = orjson.loads(await ws.recv())
            if event["event"] == "error":
                errors.append(event)
            elif event["event"] == "result":
                break
        refused = {e["id"] for e in errors}
        return [f"{prefix}{i}" for i in range(n) if f"{prefix}{i}" not in refused], errors

    async def drain(ws, accepted: list[str]) -> dict[str, str]:
        for rid in accepted:
            await ws.send(json.dumps({"op": "cancel", "id": rid}))
        finished: dict[str, str] = {}
        while len(finished) < len(accepted):
            event = orjson.loads(await ws.recv())
            if event["event"] == "done":
                finished[event["id"]] = event["finish_reason"]
        return finished

    async def scenario():
        await wait_idle(server.url)
        a, b = await raw(server.url), await raw(server.url)
        accepted_a, errors_a = await flood(a, "a", PER_CONNECTION + 6)
        accepted_b, errors_b = await flood(b, "b", capacity - PER_CONNECTION + 4)
        finished = {**await drain(a, accepted_a), **await drain(b, accepted_b)}
        await a.close()
        await b.close()
        return accepted_a, errors_a, accepted_b, errors_b, finished

    accepted_a, errors_a, accepted_b, errors_b, finished = run(scenario())
    assert len(accepted_a) == PER_CONNECTION and len(errors_a) == 6
    assert all(e["code"] == "overloaded" and "this connection" in e["message"] for e in errors_a)
    assert len(accepted_b) == capacity - PER_CONNECTION and len(errors_b) == 4
    assert all(e["code"] == "overloaded" and "busy" in e["message"] for e in errors_b)
    assert set(finished.values()) == {"cancelled"}
    run(wait_idle(server.url))


# ---- safety ---------------------------------------------------------------------------------------

def test_auth_health_and_metrics(server):
    async def refused(headers):
        with pytest.raises(InvalidStatus) as info:
            await connect(server.url, additional_headers=headers)
        return info.value.response.status_code

    assert run(refused(None)) == 401
    assert run(refused({"Authorization": f"Bearer {secrets.token_hex(16)}"})) == 401
    assert run(refused({"Authorization": API_KEY})) == 401

    status, body = server.http("/health")  # open to probes without the key
    assert status == 200 and orjson.loads(body)["status"] == "ok"
    assert server.http("/metrics")[0] == 401
    status, body = server.http("/metrics", AUTH)
    text = body.decode()
    assert status == 200
    for name in ("requests_total", "completion_tokens_total", "tokens_per_second", "queue_depth",
                 "prompt_cache_hits_total", "prompt_cache_bytes", "connections"):
        assert f"# TYPE strata_async_{name} " in text
    assert float(re.search(r"^strata_async_completion_tokens_total (\S+)$", text, re.M).group(1)) > 0


def malformed_frames(vocab_size: int) -> list[tuple[str | bytes, bool, str | None]]:
    """(payload, sent as a text frame, expected error code or None for "any"). Every one is refused."""
    rng = random.Random()
    # first, while the request "keep" is surely still running
    frames: list[tuple[str | bytes, bool, str | None]] = [
        ('{"op": "generate", "id": "keep", "prompt": "again"}', True, "duplicate_id")]
    frames += [(rng.randbytes(rng.randrange(1, 300)), False, "binary_frame") for _ in range(40)]
    frames.append((b'{"op": "status", "id": "s"}', False, "binary_frame"))
    frames += [(b, True, "invalid_utf8") for b in (b"\xff", b'{"op": "status", "id": "\xc3"}', b"\xed\xa0\x80",
                                                   b"\xc0\xaf", b"abc\x80")]
    frames += [(rng.randbytes(50) + b"\xff", True, "invalid_utf8") for _ in range(15)]
    for text, code in [("", "invalid_json"), ("{", "invalid_json"), ('{"op": "status", "id": "s",}', "invalid_json"),
                       ("[" * 3000, "invalid_json"), ("1e999", "invalid_json"), ("[]", "invalid_json"),
                       ('"op"', "invalid_json"), ("null", "invalid_json"), ('{"op": "fly", "id": "x"}', "unknown_op"),
                       ('{"op": "cancel", "id": "nobody"}', "unknown_id")]:
        frames.append((text, True, code))
    bad = [{"op": "generate", "id": "b", "prompt": "a", "max_tokens": 10 ** 18},
           {"op": "generate", "id": "b", "prompt": "a", "seed": 2 ** 64},
           {"op": "generate", "id": "b", "prompt": "a", "temperature": 1e308},
           {"op": "generate", "id": "b", "prompt": [vocab_size]},
           {"op": "generate", "id": "b", "prompt": "a", "stop": [""]},
           {"op": "generate", "id": "b", "messages": [{"role": "user", "content": ["x"]}]},
           {"op": "detokenize", "id": "d", "token_ids": [-5]},
           {"op": "tokenize", "id": "t", "text": None},
           {"op": "status", "id": ["s"]}]
    frames += [(json.dumps(obj), True, "bad_request") for obj in bad]
    # random mutations of valid frames, kept when this side's parser refuses them too
    valid = [{"op": "generate", "id": "m", "prompt": "x", "max_tokens": 4}, {"op": "detokenize", "id": "m",
                                                                             "token_ids": [1]},
             {"op": "infill", "id": "m", "prefix": "a", "suffix": "b"}, {"op": "tokenize", "id": "m", "text": "x"}]
    junk = [None, True, -1, 2 ** 64, 1.5, "", [], {}, [None], "\u0000", -1e300]
    limits = protocol.Limits(max_tokens=4096, vocab_size=vocab_size)
    while len(frames) < 250:
        obj = dict(rng.choice(valid))
        obj[rng.choice([*obj, "max_tokens", "seed", "stream", "zzz"])] = rng.choice(junk)
        text = json.dumps(obj)
        if rng.random() < 0.3:
            cut = rng.randrange(len(text))
            text = text[:cut] + rng.choice(["", "}", "\"", "\\"]) + text[cut + 1:]
        try:
            protocol.parse_frame(text, limits)
        except protocol.ProtocolError:
            frames.append((text, True, None))
    return frames


def test_fuzzed_frames_get_errors_and_spare_other_requests(server, model):
    expected = reference(model, PROMPT, max_tokens=40, temperature=0, ignore_eos=True)
    frames = malformed_frames(model.config.vocab_size)

    async def scenario():
        ws = await raw(server.url)
        await ws.send(json.dumps({"op": "generate", "id": "keep", "prompt": PROMPT, "max_tokens": 40,
                                  "temperature": 0, "ignore_eos": True}))
        errors, ids, done = [], [], None

        async def read():
            nonlocal done
            while len(errors) < len(frames) or done is None:
                event = orjson.loads(await ws.recv())
                if event["event"] == "error":
                    errors.append(event)
                elif event["id"] == "keep" and event["event"] == "token":
                    ids.extend(event["token_ids"])
                elif event["id"] == "keep" and event["event"] == "done":
                    done = event

        reader = asyncio.ensure_future(read())
        for payload, text, _ in frames:
            await ws.send(payload, text=text)
        await reader
        await ws.send(json.dumps({"op": "status", "id": "after"}))
        status = orjson.loads(await ws.recv())
        await ws.close()
        return errors, ids, done, status

    errors, ids, done, status = run(scenario())
    assert len(errors) == len(frames)
    for (payload, _, code), event in zip(frames, errors):
        assert event["message"] and event["code"] in (protocol.BAD_REQUEST, protocol.INVALID_JSON,
                                                      protocol.INVALID_UTF8, protocol.BINARY_FRAME,
                                                      protocol.UNKNOWN_OP, protocol.UNKNOWN_ID,
                                                      protocol.DUPLICATE_ID)
        if code is not None:
            assert event["code"] == code, (payload, event)
    dup = next(e for e in errors if e["code"] == "duplicate_id")
    assert dup["id"] is None  # an error must not look like the end of the request in flight
    assert (done["finish_reason"], ids) == ("length", expected[1])  # the unrelated request ran untouched
    assert status["event"] == "result" and status["op"] == "status"
    # a frame over the size limit closes only its own connection (1009), and the server serves on
    async def oversized():
        ws = await raw(server.url, max_size=None)
        await ws.send("x" * (2 << 20))
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
        async with await Client.connect(server.url, api_key=API_KEY) as client:
            result = await client.complete(PROMPT, max_tokens=3, temperature=0, ignore_eos=True)
        return info.value.rcvd.code, result

    code, result = run(oversized())
    assert code == 1009 and result.token_ids == expected[1][:3]
    assert server.alive()


def test_a_client_that_stops_reading_cannot_grow_server_memory(server, model):
    """The slow client streams a long generation and asks for detokenizations whose answers (each ~10x the
    request) would add up to far more memory than allowed, then reads nothing. Its generation is paused, the
    server stops taking its frames (its sends block), other clients are served, and the server's memory
    stays within a bound far below what the answers would need. Once it reads again, the tokens that piled up
    come several per frame."""
    special = model.encode("<|im_start|>")[0]  # renders as 12 bytes from ~4 bytes of JSON
    request = json.dumps({"op": "detokenize", "id": "d", "token_ids": [special] * 200_000})
    n_requests = 300  # 12 bytes x 200_000 x 300 = 720 MB of answers if the server kept them

    async def scenario():
        await wait_idle(server.url)
        rss_before = server.rss_bytes()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        slow = await connect(server.url, sock=sock, additional_headers=AUTH, max_queue=1, ping_interval=None,
                             compression=None, max_size=None)
        await slow.send(json.dumps({"op": "generate", "id": "g", "prompt": PROMPT, "max_tokens": 4000,
                                    "ignore_eos": True}))
        sent = 0
        for i in range(n_requests):
            try:
                await asyncio.wait_for(slow.send(request.replace('"d"', f'"d{i}"', 1)), timeout=3)
            except asyncio.TimeoutError:
                break
            sent += 1
        async with await Client.connect(server.url, api_key=API_KEY) as other:
            served = await other.complete(PROMPT, max_tokens=5, temperature=0, ignore_eos=True)
            deadline = time.monotonic() + 10
            while (status := await other.status())["paused"] < 1:
                assert time.monotonic() < deadline, status
                await asyncio.sleep(0.1)
            running = status["running"]
        rss_after = server.rss_bytes()
        # reading again, the client gets the tokens that piled up coalesced: several per frame
        most = 0
        while most < 2:
            event = orjson.loads(await asyncio.wait_for(slow.recv(), 10))
            if event["event"] == "token" and event["id"] == "g":
                most = len(event["token_ids"])
        slow.transport.abort()
        idle = await wait_idle(server.url, timeout=15)
        return sent, served, running, rss_before, rss_after, idle

    sent, served, running, rss_before, rss_after, idle = run(scenario(), timeout=120)
    assert sent < n_requests  # the server stopped reading the client's frames
    assert served.finish_reason == "length" and len(served.token_ids) == 5
    assert running >= 1
    growth = rss_after - rss_before
    assert growth < 160 << 20, f"server memory grew by {growth >> 20} MiB"
    assert idle["running"] == 0 and server.alive()


def test_complete_and_chat_commands(server, model):
    cli = [sys.executable, "-m", "strata_async.cli"]
    env = {**os.environ, "STRATA_ASYNC_API_KEY": API_KEY}
    expected = reference(model, PROMPT, max_tokens=8, temperature=0)

    def command(*args, input=None, environ=env):
        return subprocess.run([*cli, *args, "--url", server.url], input=input, capture_output=True, env=environ,
                              timeout=60)

    out = command("complete", "-p", PROMPT, "-n", "8", "--temperature", "0", "--json")
    assert out.returncode == 0, out.stderr
    result = orjson.loads(out.stdout)
    assert (result["text"], result["token_ids"], result["finish_reason"]) == expected
    out = command("complete", "-p", PROMPT, "-n", "8", "--temperature", "0")
    assert out.returncode == 0 and out.stdout.decode() == expected[0] + "\n"

    def cached_total() -> float:
        text = server.http("/metrics", AUTH)[1].decode()
        return float(re.search(r"^strata_async_cached_tokens_total (\S+)$", text, re.M).group(1))

    before = cached_total()
    out = command("chat", "-n", "4", "--temperature", "0", "--system", "Be brief.", input=b"hello\nand again\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().count("> ") >= 3  # two turns, then the prompt that met the end of input
    assert cached_total() > before  # the second turn reused the first

    out = command("complete", "-p", "x", environ={k: v for k, v in env.items() if k != "STRATA_ASYNC_API_KEY"})
    assert out.returncode == 2 and b"401" in out.stderr


# ---- in process: loading, infill, the engine's output rules ------------------------------------------

def fim_model():
    """The default model: its vocabulary holds Qwen's FIM tokens, which the tokenizer finds by their text."""
    m = strata_async.load()
    tok = m.tokenizer
    assert [tok.fim_pre_id, tok.fim_suf_id, tok.fim_mid_id] == [m.encode(f"<|fim_{name}|>")[0]
                                                                for name in ("prefix", "suffix", "middle")]
    return m


def test_fim_prompt_layout(model):
    m = fim_model()
    tok = m.tokenizer
    pre, suf, mid = tok.fim_pre_id, tok.fim_suf_id, tok.fim_mid_id

    def enc(s):
        return tok.encode(s, add_special=False, parse_special=False)

    prefix, suffix = "def area(r):\n    return ", "\n\nprint(area(2))\n"
    assert fim_prompt(tok, prefix, suffix, [], 4096) == [pre, *enc(prefix), suf, *enc(suffix), mid]
    with_context = fim_prompt(tok, prefix, suffix, [("util.py", "PI = 3.14159")], 4096)
    assert with_context == [*enc("\n\n--- snippet ---\n\n"), *enc("PI = 3.14159"), pre, *enc(prefix), suf,
                            *enc(suffix), mid]
    assert fim_prompt(tok, "<|fim_middle|>", "", [], 4096).count(mid) == 1  # code that spells a FIM token
    # too long: the context goes first, then the prefix's start and the suffix's end
    long_prefix = "x = 1\n" * 200
    trimmed = fim_prompt(tok, long_prefix, suffix, [("a.py", "y = 2\n" * 50)], 64)
    assert len(trimmed) == 64 and trimmed[0] == pre and trimmed[-1] == mid
    kept_prefix = trimmed[1:trimmed.index(suf)]
    assert kept_prefix == enc(long_prefix)[-len(kept_prefix):]
    assert trimmed[trimmed.index(suf) + 1:-1] == enc(suffix)


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    response = await reader.read()
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_health_503_while_loading_then_infill():
    gate = threading.Event()

    def load():
        gate.wait(30)
        return fim_model()

    async def scenario():
        server = Server(load, ServerConfig(port=0))
        await server.start()
        try:
            loading = await http_get(server.port, "/health")
            with pytest.raises(InvalidStatus) as info:
                await connect(f"ws://127.0.0.1:{server.port}")
            gate.set()
            await server.wait_loaded()
            ready = await http_get(server.port, "/health")
            async with await Client.connect(f"ws://127.0.0.1:{server.port}") as client:
                done = await client.infill("def add(a, b):\n    return ", "\n", max_tokens=6, temperature=0,
                                           ignore_eos=True, context=[{"filename": "m.py", "text": "import math"}]
                                           ).collect()
            return loading, info.value.response.status_code, ready, done, server.engine.tokenizer
        finally:
            gate.set()
            await server.close()

    loading, ws_status, ready, done, tok = run(scenario())
    assert loading[0] == 503 and orjson.loads(loading[1]) == {"status": "loading"}
    assert ws_status == 503
    assert ready[0] == 200 and orjson.loads(ready[1])["status"] == "ok"
    expected_prompt = fim_prompt(tok, "def add(a, b):\n    return ", "\n", [("m.py", "import math")], 4096 - 6)
    assert done.finish_reason == "length" and len(done.token_ids) == 6
    assert done.usage["prompt_tokens"] == len(expected_prompt)


def test_infill_over_the_wire_uses_the_fim_prompt(server, model):
    async def scenario():
        async with await Client.connect(server.url, api_key=API_KEY) as client:
            return await client.infill("a = ", "\nprint(a)", max_tokens=4, temperature=0, ignore_eos=True).collect()

    done = run(scenario())
    assert done.finish_reason == "length" and len(done.token_ids) == 4
    assert done.usage["prompt_tokens"] == len(fim_prompt(model.tokenizer, "a = ", "\nprint(a)", [], 4096))


def test_infill_without_fim_tokens_is_a_clear_error(model):
    md = dict(model.runtime.gguf.metadata)
    md[Keys.Tokenizer.LIST] = [t.replace("fim_", "nofim_") for t in md[Keys.Tokenizer.LIST]]
    with pytest.raises(NoFIM, match="fill-in-the-middle"):
        fim_prompt(Tokenizer(md), "a", "b", [], 4096)


def test_engine_pauses_an_unread_stream_and_drops_it_after_the_stall_timeout(model):
    greedy = SamplingParams(temperature=0.0)
    prompt = tuple(model.encode(PROMPT))

    async def scenario():
        engine = Engine(model, EngineConfig(parallel=1, backlog_tokens=4, stall_timeout_s=0.5, cache_bytes=0))
        engine.start(asyncio.get_running_loop())
        try:
            # a reader that takes its output late: paused at the backlog, resumed on each take
            slow = engine.reserve().submit(Job(prompt, 30, greedy, ignore_eos=True))
            slow_ready = asyncio.Event()
            slow.on_ready = slow_ready.set
            ids, saw_pause, most = [], False, 0
            while True:
                await slow_ready.wait()
                slow_ready.clear()
                await asyncio.sleep(0.3)
                saw_pause |= engine.paused > 0
                _, new, outcome = slow.take()
                ids += new
                most = max(most, len(new))
                if outcome is not None:
                    break
            # a reader that never takes anything: dropped after the stall timeout
            ended = asyncio.Event()
            unread = engine.reserve().submit(Job(prompt, 500, greedy, ignore_eos=True))
            unread.on_ready = lambda: unread.outcome is not None and ended.set()
            await asyncio.wait_for(ended.wait(), 20)
            return unread.outcome, outcome, ids, saw_pause, most
        finally:
            await engine.close()

    dropped, finished, ids, saw_pause, most = run(scenario())
    assert saw_pause and most >= 4  # paused at the backlog; what piled up is taken at once
    assert finished.finish_reason == "length" and ids == reference(model, PROMPT, max_tokens=30, temperature=0,
                                                                   ignore_eos=True)[1]
    assert dropped.finish_reason == "error" and dropped.error[0] == "slow_consumer"
    assert dropped.completion_tokens < 40  # it stopped at the backlog instead of generating 500 tokens


def test_ple_table_counters_on_metrics(tmp_path, qwen4exp_f32_gguf):
    """A qwen4exp server reads its n-gram table rows with O_DIRECT and exports the table's counters."""
    async def generate(url):
        async with await Client.connect(url, api_key=API_KEY) as client:
            return [e async for e in client.generate("one two three", max_tokens=5, temperature=0)]

    with start_server(tmp_path / "server.log", str(qwen4exp_f32_gguf), "--port", "0", "--ple-io", "direct",
                      "--ple-cache-rows", "8") as handle:
        assert run(generate(handle.url))
        text = handle.http("/metrics", AUTH)[1].decode()

    def value(name: str) -> float:
        return float(re.search(rf"^strata_async_{name} (\S+)$", text, re.M).group(1))

    heads = 4  # (ngram_size - 1) * heads_per_ngram of the tiny checkpoint
    assert value("ple_rows_read_total") >= 5 * heads
    assert value("ple_bytes_read_total") == 64 * value("ple_rows_read_total")  # F32 rows of 16 values
    assert 'strata_async_ple_wait_seconds{stat="p99"}' in text
