"""The WebSocket server: the protocol of protocol.py over the websockets library, plus /health and /metrics.

One asyncio event loop serves every connection; it never computes. Model work runs in the engine's worker
thread; tokenizing prompts, rendering chat templates and decoding token ids run in one text thread.

Per connection, a reader parses frames and starts, cancels or answers requests, and a writer sends the
requests' output as it comes, coalescing the tokens that piled up while a send was waiting (a slow
reader gets fewer, larger token frames). Memory per connection is bounded: at most
`max_requests_per_connection` requests in flight, frames of at most `max_frame_bytes`, the engine's
per-request backlog, and websockets' write limit: while a send waits for the client, that connection
reads no new frames.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import jinja2
import orjson
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from . import __version__
from .engine import Engine, EngineConfig, Job, NoFIM, Outcome, Overloaded, RequestStream, chat_prompt, fim_prompt
from .model import Model
from .protocol import (BAD_REQUEST, CONTEXT_EXCEEDED, DUPLICATE_ID, INTERNAL, NO_FIM, NO_TEMPLATE, OVERLOADED,
                       PROTOCOL_VERSION, UNKNOWN_ID, Cancel, ClientMessage, Detokenize, Generate, Infill, Limits,
                       ProtocolError, Status, Timings, Tokenize, Usage, done_event, error_event, invalid_utf8,
                       parse_frame, result_event, token_event)
from .sampling import SamplingParams
from .tokenizer import TokenizerError

__all__ = ["Server", "ServerConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765  # 0 picks a free port (see Server.port)
    api_key: str | None = None  # when set, WebSocket and /metrics need "Authorization: Bearer <key>"
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_frame_bytes: int = 1 << 20  # incoming frames; larger ones close the connection (1009)
    max_requests_per_connection: int = 32
    max_tokens: int | None = None  # per request; default and upper bound: the model's context
    write_limit: int = 1 << 16  # bytes buffered for a client before sends wait for it
    ping_interval_s: float | None = 20.0  # keepalive: a client that answers no ping for this long is dropped


class Server:
    """Listens at once; loads the model in a thread (/health answers 503 until it is ready), then serves."""

    def __init__(self, load_model: Callable[[], Model], config: ServerConfig = ServerConfig()):
        self.config = config
        self.engine: Engine | None = None  # set once the model is loaded and warmed up
        self.limits = Limits(max_frame_bytes=config.max_frame_bytes)
        self.errors: dict[str, int] = {}  # error events sent, by code
        self.connections = 0
        self._load_model = load_model
        self._loading: asyncio.Task | None = None
        self._load_error: BaseException | None = None
        self._text_pool = ThreadPoolExecutor(1, thread_name_prefix="strata-async-text")
        self._clients = itertools.count(1)
        self._ws_server = None

    # -- lifecycle --

    async def start(self) -> None:
        self._ws_server = await serve(
            self._handle, self.config.host, self.config.port, process_request=self._process_request,
            max_size=self.config.max_frame_bytes, max_queue=4, write_limit=self.config.write_limit,
            compression=None, ping_interval=self.config.ping_interval_s, ping_timeout=self.config.ping_interval_s,
            server_header=f"strata-async/{__version__}")
        self._loading = asyncio.create_task(self._load())

    @property
    def port(self) -> int:
        return self._ws_server.sockets[0].getsockname()[1]

    async def wait_loaded(self) -> None:
        """Return once the model serves; raise what loading it raised."""
        await asyncio.shield(self._loading)

    async def close(self) -> None:
        if self._ws_server is not None:
            self._ws_server.close()
            await self._ws_server.wait_closed()
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self.engine is not None:
            await self.engine.close()
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            def load() -> Engine:
                engine = Engine(self._load_model(), self.config.engine)
                engine.warm_up()
                return engine

            engine = await loop.run_in_executor(None, load)
        except BaseException as exc:
            self._load_error = exc
            raise
        context = engine.runtime.max_context
        self.limits = Limits(max_frame_bytes=self.config.max_frame_bytes,
                             max_tokens=min(self.config.max_tokens or context, context),
                             max_prompt_chars=self.config.max_frame_bytes, vocab_size=engine.model.config.vocab_size)
        engine.start(loop)
        self.engine = engine

    # -- HTTP: /health, /metrics, auth --

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == "/health":
            if self.engine is not None:
                return _respond(connection, 200, _json({"status": "ok", "model": self.engine.model.name,
                                                        "protocol": PROTOCOL_VERSION}))
            state = {"status": "error", "message": str(self._load_error)} if self._load_error else {"status": "loading"}
            return _respond(connection, 503, _json(state))
        if not self._authorized(request):
            response = _respond(connection, 401, _json({"status": "unauthorized",
                                                        "message": "send Authorization: Bearer <api key>"}))
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if path == "/metrics":
            return _respond(connection, 200, self._metrics(), "text/plain; version=0.0.4; charset=utf-8")
        if self.engine is None:
            return _respond(connection, 503, _json({"status": "loading", "message": "the model is loading; retry"}))
        return None  # go on with the WebSocket handshake

    def _authorized(self, request: Request) -> bool:
        if self.config.api_key is None:
            return True
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, f"Bearer {self.config.api_key}".encode())

    def _metrics(self) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: dict[str, float] | float) -> None:
            lines.append(f"# HELP strata_async_{name} {help_text}")
            lines.append(f"# TYPE strata_async_{name} {kind}")
            for labels, value in (samples.items() if isinstance(samples, dict) else [("", samples)]):
                lines.append(f"strata_async_{name}{labels} {value:g}")

        e = self.engine
        metric("model_loaded", "gauge", "1 once the model serves.", 1 if e else 0)
        metric("connections", "gauge", "Open WebSocket connections.", self.connections)
        metric("errors_total", "counter", "Error events sent, by code.",
               {f'{{code="{c}"}}': n for c, n in sorted(self.errors.items())})
        if e is not None:
            s = e.stats
            metric("requests_total", "counter", "Generate and infill requests ended, by finish reason.",
                   {f'{{finish_reason="{r}"}}': s.finished[r] for r in ("stop", "length", "cancelled", "error")})
            metric("prompt_tokens_total", "counter", "Prompt tokens of ended requests.", s.prompt_tokens)
            metric("cached_tokens_total", "counter", "Prompt tokens restored from the prompt cache.", s.cached_tokens)
            metric("completion_tokens_total", "counter", "Tokens generated.", s.completion_tokens)
            metric("tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
                   s.tokens_per_second())
            metric("running", "gauge", "Requests holding a slot.", e.running)
            metric("queue_depth", "gauge", "Requests taken but not running: being prepared or waiting for a slot.",
                   e.queued)
            metric("paused", "gauge", "Running requests paused because their client is not reading.", e.paused)
            c = e.cache
            metric("prompt_cache_hits_total", "counter", "Requests that reused a prompt-cache snapshot.",
                   c.stats.hits if c else 0)
            metric("prompt_cache_misses_total", "counter", "Requests that found no usable snapshot.",
                   c.stats.misses if c else 0)
            metric("prompt_cache_bytes", "gauge", "Bytes held by prompt-cache snapshots.", c.nbytes if c else 0)
            metric("prompt_cache_entries", "gauge", "Prompt-cache snapshots held.", len(c) if c else 0)
            table = getattr(e.runtime.model, "ple_table", None)
            if table is not None:
                t = table.stats
                metric("ple_rows_read_total", "counter", "n-gram PLE table rows read from its file.", t.rows_read)
                metric("ple_bytes_read_total", "counter", "n-gram PLE table bytes read from its file.", t.bytes_read)
                metric("ple_cache_hits_total", "counter", "n-gram PLE rows served from the row cache.", t.cache_hits)
                metric("ple_wait_seconds", "gauge", "Wait for PLE rows per forward step: mean and p99.",
                       {'{stat="mean"}': t.wait_mean_s, '{stat="p99"}': t.wait_p99_s})
        return "\n".join(lines) + "\n"

    def status(self) -> dict[str, Any]:
        e = self.engine
        tok = e.tokenizer
        cache = e.cache
        return {
            "protocol": PROTOCOL_VERSION, "version": __version__, "model": e.model.name,
            "vocab_size": e.model.config.vocab_size, "max_context": e.runtime.max_context,
            "max_tokens": self.limits.max_tokens, "fim": None not in (tok.fim_pre_id, tok.fim_suf_id, tok.fim_mid_id),
            "chat_template": bool(tok.chat_template), "parallel": e.config.parallel, "max_queue": e.config.max_queue,
            "running": e.running, "queued": e.queued, "paused": e.paused, "connections": self.connections,
            "prompt_cache": {"entries": len(cache) if cache else 0, "bytes": cache.nbytes if cache else 0,
                             "capacity_bytes": e.config.cache_bytes, "hits": cache.stats.hits if cache else 0,
                             "misses": cache.stats.misses if cache else 0},
        }

    # -- requests --

    async def run_text(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run tokenizer work off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn, *args)

    def build_job(self, msg: Generate | Infill, client: int, received_at: float) -> Job:
        """Token ids and sampling of a request (runs in the text thread); ProtocolError when it cannot run."""
        engine = self.engine
        tok, context = engine.tokenizer, engine.runtime.max_context
        s = msg.sampling
        try:
            if isinstance(msg, Infill):
                budget = context - s.max_tokens
                if budget < 8:
                    raise ProtocolError(CONTEXT_EXCEEDED, f"max_tokens {s.max_tokens} leaves no room for an infill "
                                                          f"prompt in the context of {context} tokens")
                chunks = [(c.filename, c.text) for c in msg.context]
                ids = fim_prompt(tok, msg.prefix, msg.suffix, chunks, budget)
            elif msg.messages is not None:
                if not tok.chat_template:
                    raise ProtocolError(NO_TEMPLATE, "the model has no chat template: send \"prompt\" text instead")
                ids = chat_prompt(tok, msg.messages)
            elif isinstance(msg.prompt, str):
                ids = tok.encode(msg.prompt)
            else:
                ids = list(msg.prompt)
            sampling = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                      repetition_penalty=s.repetition_penalty, seed=s.seed)
        except NoFIM as exc:
            raise ProtocolError(NO_FIM, str(exc)) from None
        except (TokenizerError, jinja2.TemplateError, ValueError) as exc:
            raise ProtocolError(BAD_REQUEST, f"cannot build the prompt: {exc}") from None
        if len(ids) >= context:
            raise ProtocolError(CONTEXT_EXCEEDED, f"the prompt has {len(ids)} tokens but the context holds {context}, "
                                                  f"which leaves no room to generate; shorten the prompt")
        return Job(tuple(ids), s.max_tokens, sampling, s.stop, s.ignore_eos, msg.stream, msg.cache,
                   msg.session if isinstance(msg, Generate) else None, client, received_at)

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        try:
            await _Connection(self, ws, next(self._clients)).run()
        finally:
            self.connections -= 1

    def count_error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1


@dataclass
class _Request:
    """A generate/infill in flight on a connection."""
    id: str
    streaming: bool
    stream: RequestStream | None = None  # None while its prompt is being prepared
    cancelled: bool = False  # cancelled while being prepared (the engine is told once it has the request)

    def cancel(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        else:
            self.cancelled = True


class _Connection:
    def __init__(self, server: Server, ws: ServerConnection, client: int):
        self.server = server
        self.engine = server.engine
        self.ws = ws
        self.client = client
        self.requests: dict[str, _Request] = {}  # generate/infill in flight, by the client's id
        self.ready: dict[str, None] = {}  # ids of requests with output to send, oldest first
        self.wake = asyncio.Event()  # set when `ready` gains an id
        self.tasks: set[asyncio.Task] = set()  # requests being prepared

    async def run(self) -> None:
        writer = asyncio.create_task(self._write_loop())
        try:
            await self._read_loop()
        except ConnectionClosed:
            pass
        finally:
            for req in self.requests.values():  # a disconnect cancels the connection's requests
                req.cancel()
            writer.cancel()
            await asyncio.gather(writer, *self.tasks, return_exceptions=True)

    async def _read_loop(self) -> None:
        while True:
            frame = await _receive(self.ws)
            if frame is None:
                return
            msg = None
            try:
                if isinstance(frame, UnicodeDecodeError):
                    raise invalid_utf8(frame)
                msg = parse_frame(frame, self.server.limits)
                await self._dispatch(msg)
            except ProtocolError as err:
                await self._send_error(err.request_id, err.code, err.message)
            except (ConnectionClosed, asyncio.CancelledError):
                raise
            except Exception as exc:  # a failure answering one frame must not end the connection's other requests
                log.error("answering a frame failed", exc_info=exc)
                await self._send_error(msg.id if msg is not None else None, INTERNAL, f"{type(exc).__name__}: {exc}")

    async def _dispatch(self, msg: ClientMessage) -> None:
        if isinstance(msg, Cancel):
            req = self.requests.get(msg.id)
            if req is None:
                raise ProtocolError(UNKNOWN_ID, f"no request {msg.id!r} in flight on this connection", msg.id)
            req.cancel()
            return
        if msg.id in self.requests:
            raise ProtocolError(DUPLICATE_ID, f"request {msg.id!r} is still in flight on this connection; "
                                              "use a new id", msg.id)
        if isinstance(msg, (Generate, Infill)):
            self._start(msg)
        elif isinstance(msg, Tokenize):
            ids = await self.server.run_text(self.engine.tokenizer.encode, msg.text, msg.add_special)
            await self._send(result_event(msg.id, "tokenize", token_ids=ids))
        elif isinstance(msg, Detokenize):
            text = await self.server.run_text(self.engine.tokenizer.decode, msg.token_ids)
            await self._send(result_event(msg.id, "detokenize", text=text))
        elif isinstance(msg, Status):
            await self._send(result_event(msg.id, "status", **self.server.status()))

    def _start(self, msg: Generate | Infill) -> None:
        received_at = time.perf_counter()
        limit = self.server.config.max_requests_per_connection
        if len(self.requests) >= limit:
            raise ProtocolError(OVERLOADED, f"this connection has {limit} requests in flight, the most allowed; "
                                            "wait for one to finish", msg.id)
        try:
            reservation = self.engine.reserve()
        except Overloaded as exc:
            raise ProtocolError(OVERLOADED, str(exc), msg.id) from None
        req = self.requests[msg.id] = _Request(msg.id, msg.stream)
        task = asyncio.create_task(self._prepare(req, msg, reservation, received_at))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _prepare(self, req: _Request, msg: Generate | Infill, reservation, received_at: float) -> None:
        try:
            job = await self.server.run_text(self.server.build_job, msg, self.client, received_at)
            req.stream = reservation.submit(job)
        except BaseException as exc:
            reservation.release()
            del self.requests[req.id]
            if isinstance(exc, ProtocolError):
                await self._send_error(req.id, exc.code, exc.message)
            elif isinstance(exc, Exception):
                log.error("preparing request %r failed", req.id, exc_info=exc)
                await self._send_error(req.id, INTERNAL, f"{type(exc).__name__}: {exc}")
            else:
                raise
            return
        req.stream.on_ready = lambda: self._mark_ready(req.id)
        if req.cancelled:  # while being prepared: the engine ends it at once, as any cancelled request
            req.stream.cancel()

    def _mark_ready(self, request_id: str) -> None:
        self.ready[request_id] = None
        self.wake.set()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                while self.ready:
                    rid = next(iter(self.ready))
                    del self.ready[rid]
                    req = self.requests.get(rid)
                    if req is None or req.stream is None:
                        continue
                    text, ids, outcome = req.stream.take()
                    if req.streaming and (text or ids):
                        await self._send(token_event(rid, text, ids))
                    if outcome is not None:
                        del self.requests[rid]
                        await self._send(_done(rid, outcome, None if req.streaming else text, ids))
        except ConnectionClosed:
            pass
        except Exception as exc:  # without its writer the connection cannot go on: say so and close it
            log.error("sending to a client failed", exc_info=exc)
            await self.ws.close(1011, "internal error")

    async def _send(self, frame: bytes) -> None:
        await self.ws.send(frame, text=True)

    async def _send_error(self, request_id: str | None, code: str, message: str) -> None:
        # An error carrying the id of a request in flight would read as that request's end: leave the id out.
        if request_id is not None and request_id in self.requests:
            request_id = None
        self.server.count_error(code)
        await self._send(error_event(request_id, code, message))


def _done(request_id: str, o: Outcome, text: str | None, ids: list[int]) -> bytes:
    return done_event(request_id, o.finish_reason, Usage(o.prompt_tokens, o.completion_tokens, o.cached_tokens),
                      Timings(ttft_s=o.ttft_s, prefill_tok_s=o.prefill_tok_s, decode_tok_s=o.decode_tok_s,
                              queue_s=o.queue_s, prefill_s=o.prefill_s),
                      text=text, token_ids=ids if text is not None else None, error=o.error)


async def _receive(ws: ServerConnection) -> str | bytes | UnicodeDecodeError | None:
    """The next message (str: text frame, bytes: binary frame), the decoding error of a text frame that is
    not UTF-8, or None once the connection has closed.

    ws.recv() would fail the whole connection on invalid UTF-8 (close code 1007); the protocol answers it
    with an error event instead, so messages are taken from the connection's message assembler directly.
    """
    try:
        return await ws.recv_messages.get(None)
    except UnicodeDecodeError as exc:
        return exc
    except EOFError:
        return None


def _json(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _respond(connection: ServerConnection, status: int, body: str, content_type: str = "application/json") -> Response:
    response = connection.respond(status, body)
    del response.headers["Content-Type"]
    response.headers["Content-Type"] = content_type
    return response
