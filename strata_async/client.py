"""A Python client for the strata-async server (protocol version 1, docs/protocol.md).

    async with await Client.connect("ws://127.0.0.1:8765", api_key=None) as client:
        async for event in client.generate("def add(", max_tokens=32, temperature=0):
            if isinstance(event, TokenEvent):
                print(event.text, end="", flush=True)
        print(event.finish_reason, event.usage)

Several requests may run at once on one client: each `generate`/`infill` stream receives only its own
events. An error event for a request raises ServerError from its iterator.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

__all__ = ["Client", "Completion", "DoneEvent", "ServerError", "Stream", "TokenEvent"]

DEFAULT_URL = "ws://127.0.0.1:8765"


class ServerError(Exception):
    """An error event: the request (or frame) was refused, or failed."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class TokenEvent:
    id: str
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class DoneEvent:
    id: str
    finish_reason: str  # stop | length | cancelled | error
    usage: dict[str, int]  # prompt_tokens, completion_tokens, cached_tokens
    timings: dict[str, float]  # ttft_s, prefill_tok_s, decode_tok_s, queue_s, prefill_s
    text: str | None = None  # the whole output, for requests sent with stream=False
    token_ids: list[int] | None = None
    error: dict[str, str] | None = None  # code and message when finish_reason is "error"


@dataclass
class Completion:
    """A whole response: what `Stream.collect` and `Client.complete` return."""
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float]
    token_frames: int = 0  # token events received (fewer than tokens when the server coalesced them)


class Stream:
    """The events of one generate/infill request; iterate it (the request is sent on first use or `start`)."""

    def __init__(self, client: Client, frame: dict[str, Any]):
        self.client = client
        self.id: str = frame["id"]
        self._frame = frame
        self._sent = False
        self._done = False
        self._events: asyncio.Queue[dict | BaseException] = asyncio.Queue()

    async def start(self) -> Stream:
        """Send the request now (iterating sends it too)."""
        if not self._sent:
            self._sent = True
            self.client._streams[self.id] = self
            try:
                await self.client._send(self._frame)
            except BaseException:
                self.client._streams.pop(self.id, None)
                raise
        return self

    async def cancel(self) -> None:
        """Ask the server to stop; the stream then ends with finish_reason "cancelled"."""
        if self._sent and not self._done:
            await self.client._send({"op": "cancel", "id": self.id})

    def __aiter__(self) -> AsyncIterator[TokenEvent | DoneEvent]:
        return self

    async def __anext__(self) -> TokenEvent | DoneEvent:
        if self._done:
            raise StopAsyncIteration
        await self.start()
        item = await self._events.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        event = item.get("event")
        if event == "token":
            return TokenEvent(self.id, item["text"], item["token_ids"])
        self._done = True
        self.client._streams.pop(self.id, None)
        if event == "error":
            raise ServerError(item.get("code", "?"), item.get("message", ""), self.id)
        return DoneEvent(self.id, item["finish_reason"], item["usage"], item["timings"], item.get("text"),
                         item.get("token_ids"), item.get("error"))

    async def collect(self) -> Completion:
        """Read the stream to its end; raise ServerError if it failed."""
        texts: list[str] = []
        ids: list[int] = []
        frames = 0
        async for event in self:
            if isinstance(event, TokenEvent):
                texts.append(event.text)
                ids += event.token_ids
                frames += 1
        if event.finish_reason == "error":
            err = event.error or {}
            raise ServerError(err.get("code", "internal"), err.get("message", ""), self.id)
        if event.text is not None:
            texts, ids = [event.text], list(event.token_ids or [])
        return Completion("".join(texts), ids, event.finish_reason, event.usage, event.timings, frames)

    def _push(self, item: dict | BaseException) -> None:
        self._events.put_nowait(item)


@dataclass
class Client:
    """One WebSocket connection to a strata-async server."""
    ws: ClientConnection
    errors: list[ServerError] = field(default_factory=list)  # error events not tied to a request of ours
    _streams: dict[str, Stream] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _reader: asyncio.Task | None = None

    @classmethod
    async def connect(cls, url: str = DEFAULT_URL, *, api_key: str | None = None, **options: Any) -> Client:
        """Open a connection; `options` go to websockets.asyncio.client.connect."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        options.setdefault("max_size", 1 << 26)
        options.setdefault("compression", None)
        ws = await connect(url, additional_headers=headers, **options)
        client = cls(ws)
        client._reader = asyncio.create_task(client._read())
        return client

    async def close(self) -> None:
        await self.ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- requests --

    def generate(self, prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict] | None = None,
                 id: str | None = None, **params: Any) -> Stream:
        """A generate request from prompt text (or token ids) or chat messages; params as in the protocol
        (max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop, ignore_eos, session,
        stream, cache)."""
        frame: dict[str, Any] = {"op": "generate", "id": id or self._new_id(), **params}
        if messages is not None:
            frame["messages"] = list(messages)
        else:
            frame["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
        return Stream(self, frame)

    def infill(self, prefix: str, suffix: str = "", *, context: Sequence[str | dict] = (), id: str | None = None,
               **params: Any) -> Stream:
        """A fill-in-the-middle request: the text between prefix and suffix, with other files as context."""
        frame = {"op": "infill", "id": id or self._new_id(), "prefix": prefix, "suffix": suffix, **params}
        if context:
            frame["context"] = list(context)
        return Stream(self, frame)

    async def complete(self, prompt: str | Sequence[int] | None = None, **params: Any) -> Completion:
        """Generate and wait for the whole result."""
        return await self.generate(prompt, **params).collect()

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return (await self._call({"op": "tokenize", "text": text, "add_special": add_special}))["token_ids"]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return (await self._call({"op": "detokenize", "token_ids": list(token_ids)}))["text"]

    async def status(self) -> dict[str, Any]:
        return await self._call({"op": "status"})

    # -- plumbing --

    def _new_id(self) -> str:
        return f"c{next(self._ids)}"

    async def _call(self, frame: dict[str, Any]) -> dict[str, Any]:
        stream = Stream(self, {"id": self._new_id(), **frame})
        await stream.start()
        item = await stream._events.get()
        self._streams.pop(stream.id, None)
        if isinstance(item, BaseException):
            raise item
        if item.get("event") == "error":
            raise ServerError(item.get("code", "?"), item.get("message", ""), stream.id)
        return item

    async def _send(self, frame: dict[str, Any]) -> None:
        await self.ws.send(orjson.dumps(frame), text=True)

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            async for message in self.ws:
                event = orjson.loads(message)
                stream = self._streams.get(event.get("id")) if isinstance(event.get("id"), str) else None
                if stream is not None:
                    stream._push(event)
                elif event.get("event") == "error":
                    self.errors.append(ServerError(event.get("code", "?"), event.get("message", ""), event.get("id")))
                    del self.errors[:-100]  # keep the latest only
        except ConnectionClosed as exc:
            error = exc
        finally:
            closed = error or ConnectionError("the connection to the server closed")
            for stream in list(self._streams.values()):
                stream._push(closed)
            self._streams.clear()
