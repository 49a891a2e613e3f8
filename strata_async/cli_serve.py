"""The `serve`, `chat` and `complete` commands of the strata-async command line.

serve runs the WebSocket server (protocol in docs/protocol.md); chat and complete talk to one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Coroutine
from typing import Any

import orjson

API_KEY_ENV = "STRATA_ASYNC_API_KEY"
EXIT_USER_ERROR = 2
MIB = 1 << 20


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Add serve, chat and complete to the `strata-async` parser's subcommands."""
    from .cli import add_load_options

    serve = commands.add_parser(
        "serve", help="serve a model over WebSockets",
        description="Serve a model over WebSockets (protocol: docs/protocol.md), with GET /health and GET /metrics "
                    f"on the same port. The API key may also come from ${API_KEY_ENV}.")
    serve.set_defaults(command=_serve)
    serve.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (any shard of a split model)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it)")
    serve.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help="require 'Authorization: Bearer KEY' on WebSocket connections and /metrics")
    serve.add_argument("--parallel", type=int, default=1, help="requests computed at once (default 1)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting beyond the running ones; more get an 'overloaded' error (default 64)")
    serve.add_argument("--cache-mib", type=float, default=256, help="prompt cache size in MiB, 0 = off (default 256)")
    serve.add_argument("--snapshot-interval", type=int, default=256,
                       help="prompt-cache snapshot every N prompt tokens (default 256)")
    serve.add_argument("--max-tokens", type=int, help="most tokens one request may generate (default: the context)")
    serve.add_argument("--max-frame-bytes", type=int, default=MIB, help="largest incoming frame (default 1 MiB)")
    serve.add_argument("--max-requests-per-connection", type=int, default=32,
                       help="requests one connection may have in flight (default 32)")
    serve.add_argument("--backlog-tokens", type=int, default=256,
                       help="unread tokens of a stream before it is paused for its slow reader (default 256)")
    serve.add_argument("--stall-timeout", type=float, default=60.0,
                       help="seconds a paused stream may wait for its reader before it is dropped (default 60)")
    serve.add_argument("-t", "--threads", type=int, help="CPU threads (default: all)")
    serve.add_argument("--max-context", type=int, help="most tokens a sequence may hold (default: the model's)")
    serve.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per forward step (default 256)")
    add_load_options(serve)

    chat = commands.add_parser("chat", help="chat with a running server in the terminal",
                               description="Chat with a strata-async server: type a message, Enter sends it; "
                                           "Ctrl-C stops a reply, Ctrl-D (end of input) quits.")
    chat.set_defaults(command=_chat)
    _add_connection_args(chat)
    chat.add_argument("--system", help="a system message to start the conversation with")
    _add_sampling_args(chat, max_tokens=512)

    complete = commands.add_parser("complete", help="one completion from a running server (for scripts)",
                                   description="Send one prompt to a strata-async server and print the result.")
    complete.set_defaults(command=_complete)
    _add_connection_args(complete)
    complete.add_argument("-p", "--prompt", required=True, help="prompt text; '-' reads it from stdin")
    complete.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    complete.add_argument("--json", action="store_true",
                          help="print one JSON object (text, token_ids, finish_reason, usage, timings)")
    _add_sampling_args(complete, max_tokens=256)


def _add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="ws://127.0.0.1:8765", help="server address (default ws://127.0.0.1:8765)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"API key (default ${API_KEY_ENV})")


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("-n", "--max-tokens", type=int, default=max_tokens, help=f"default {max_tokens}")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--min-p", type=float, default=0.05)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", nargs="+", default=[], metavar="STR")


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
              "top_p": args.top_p, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty}
    if args.seed is not None:
        params["seed"] = args.seed
    if args.stop:
        params["stop"] = args.stop
    return params


def _run(main: Coroutine) -> Any:
    """Run a coroutine on uvloop where it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


# ---- serve ----------------------------------------------------------------------------------------

def _serve(args: argparse.Namespace) -> int:
    from .cli import _model_path, _note, _note_first_compile, load_options
    from .engine import EngineConfig
    from .server import ServerConfig

    engine = EngineConfig(parallel=args.parallel, max_queue=args.max_queue, cache_bytes=int(args.cache_mib * MIB),
                          snapshot_interval=args.snapshot_interval, backlog_tokens=args.backlog_tokens,
                          stall_timeout_s=args.stall_timeout)
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key or None, engine=engine,
                          max_frame_bytes=args.max_frame_bytes,
                          max_requests_per_connection=args.max_requests_per_connection, max_tokens=args.max_tokens)
    for name in ("max_frame_bytes", "max_requests_per_connection", "prefill_chunk"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        _note(f"warning: serving on {args.host} without --api-key: anyone who can reach it may use it")
    path = _model_path(args.model)
    _note_first_compile()
    logging.basicConfig(level=logging.WARNING, format="strata-async: %(name)s: %(message)s")

    def load_model():
        from .model import load

        return load(path, threads=args.threads, max_context=args.max_context, prefill_chunk=args.prefill_chunk,
                    **load_options(args))

    return _run(_serve_until_stopped(load_model, config))


async def _serve_until_stopped(load_model, config) -> int:
    from .cli import _note
    from .server import Server

    server = Server(load_model, config)
    await server.start()
    scheme_host = f"[{config.host}]" if ":" in config.host else config.host
    _note(f"listening on ws://{scheme_host}:{server.port} (GET /health, /metrics); loading the model ...")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not on this platform: Ctrl-C still ends the loop
            pass
    try:
        loaded = asyncio.ensure_future(server.wait_loaded())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([loaded, stopped], return_when=asyncio.FIRST_COMPLETED)
        if loaded.done():
            loaded.result()  # raises if loading failed
            _note(f"ready: {server.engine.model.name}, {config.engine.parallel} slot(s)")
            await stopped
        _note("shutting down")
        return 0
    finally:
        await server.close()


# ---- chat and complete --------------------------------------------------------------------------

async def _connect(args: argparse.Namespace):
    from websockets.exceptions import InvalidHandshake, InvalidURI

    from .client import Client

    try:
        return await Client.connect(args.url, api_key=args.api_key or None)
    except (InvalidHandshake, InvalidURI) as exc:
        raise ConnectionError(f"cannot connect to {args.url}: {exc}") from None


def _complete(args: argparse.Namespace) -> int:
    return _run(_complete_async(args))


async def _complete_async(args: argparse.Namespace) -> int:
    from .client import ServerError, TokenEvent

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    client = await _connect(args)
    try:
        if args.chat:
            stream = client.generate(messages=[{"role": "user", "content": prompt}], **_sampling(args))
        else:
            stream = client.generate(prompt, **_sampling(args))
        if args.json:
            result = await stream.collect()
            sys.stdout.buffer.write(orjson.dumps({"text": result.text, "token_ids": result.token_ids,
                                                  "finish_reason": result.finish_reason, "usage": result.usage,
                                                  "timings": result.timings}) + b"\n")
            return 0
        async for event in stream:
            if isinstance(event, TokenEvent):
                sys.stdout.write(event.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        if event.finish_reason == "error":
            print(f"strata-async: error: {event.error}", file=sys.stderr)
            return 1
        return 0
    except ServerError as exc:
        print(f"strata-async: error: {exc}", file=sys.stderr)
        return 1
    finally:
        sys.stdout.flush()
        await client.close()


def _chat(args: argparse.Namespace) -> int:
    return _run(_chat_async(args))


async def _chat_async(args: argparse.Namespace) -> int:
    from .client import ServerError, TokenEvent

    client = await _connect(args)
    loop = asyncio.get_running_loop()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    session = uuid.uuid4().hex  # lets the server's prompt cache keep this conversation's latest turn
    try:
        while True:
            line = await _read_line(loop, "> ")
            if line is None:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            stream = client.generate(messages=messages, session=session, **_sampling(args))
            _on_interrupt(loop, lambda: asyncio.ensure_future(stream.cancel()))
            reply: list[str] = []
            try:
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        reply.append(event.text)
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
            except ServerError as exc:
                print(f"\n[error: {exc}]", file=sys.stderr)
                messages.pop()
                continue
            finally:
                _on_interrupt(loop, None)
            sys.stdout.write("\n" if event.finish_reason != "cancelled" else " [stopped]\n")
            messages.append({"role": "assistant", "content": "".join(reply)})
    finally:
        await client.close()


def _on_interrupt(loop: asyncio.AbstractEventLoop, action) -> None:
    """Ctrl-C runs `action` (stop the reply) while one streams; otherwise it ends the program as usual."""
    try:
        if action is None:
            loop.remove_signal_handler(signal.SIGINT)
        else:
            loop.add_signal_handler(signal.SIGINT, action)
    except (NotImplementedError, RuntimeError):
        pass


def _read_line(loop: asyncio.AbstractEventLoop, prompt: str) -> asyncio.Future:
    """A line from the terminal (None at end of input), read in a daemon thread so the loop keeps running."""
    future = loop.create_future()

    def read() -> None:
        try:
            line = input(prompt)
        except EOFError:
            line = None
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(line))

    threading.Thread(target=read, daemon=True).start()
    return future
