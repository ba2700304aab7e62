"""Streams to the client: an engine's chat chunks relayed as server-sent events, or translated
into another API's events (Responses, Messages), with the exchange finished however they end."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

import orjson
import structlog
from fastapi import Response
from fastapi.responses import StreamingResponse

from backends.base import Body
from gateway.http.exchange import Exchange
from gateway.http.tool_arguments import Calls
from gateway.service.dispatch import Served
from gateway.service.keys import metering
from policies.errors import TriageError

log = structlog.get_logger("triage.api")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Translator(Protocol):
    """Chat chunks in, another API's events out (``responses.StreamTranslator``, Anthropic's)."""

    def start(self) -> bytes: ...
    def feed(self, chunk: Body) -> bytes: ...
    def end(self) -> bytes: ...
    def fail(self, exc: TriageError) -> bytes: ...


def events(data: bytes, headers: dict[str, str]) -> Response:
    """A whole answer (a typed decision) sent as its event sequence."""
    return Response(data, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})


def chat_chunks(ex: Exchange, served: Served, kind: str, asked_usage: bool) -> AsyncGenerator[bytes, None]:
    """Chat (or text completion) chunks relayed; a failure after the stream started becomes an SSE
    error event, then [DONE]. The usage chunk is relayed only when the client asked for it."""
    return _relay(ex, served, None, _meter(ex, served, kind, asked_usage))


def translated(ex: Exchange, served: Served, translator: Translator) -> AsyncGenerator[bytes, None]:
    """Another API's event stream over a chat stream: a failure after the start is that API's error event."""
    return _relay(ex, served, translator, _meter(ex, served, "chat", True))


def _meter(ex: Exchange, served: Served, kind: str, asked_usage: bool) -> metering.StreamMeter:
    """The stream's meter; a response cache hit's counts against no key's limits as it is relayed
    (it is charged what the cache charges: no engine ran)."""
    hit = ex.cache is not None and ex.cache.result == "hit"
    return metering.StreamMeter(ex.rt, None if hit else ex.key, served.model, kind, ex.prompt, asked_usage)


async def _relay(
    ex: Exchange, served: Served, translator: Translator | None, meter: metering.StreamMeter
) -> AsyncGenerator[bytes, None]:
    assert served.stream is not None
    status, error = 499, None  # until the upstream finishes, a stop is the client going away
    calls = Calls()
    try:
        if translator is not None:
            yield translator.start()
        async for chunk in served.stream:
            passes = meter.feed(chunk)
            calls.feed(chunk)
            if translator is None:
                if passes:
                    chunk["model"] = served.model
                    yield b"data: " + orjson.dumps(meter.strip(chunk)) + b"\n\n"
            elif data := translator.feed(chunk):
                yield data
            await meter.checkpoint()  # a limited key's stream stops here at its limit
        status = 200
        calls.flag(ex.request_id, served.model, served.backend)
        if translator is not None:
            if meter.estimated:  # the engine said nothing: the translator's usage is the estimate
                translator.feed({"choices": [], "usage": meter.usage()})
            yield translator.end()
    except TriageError as exc:
        status, error = exc.status, exc
        log.warning("stream_failed", request_id=ex.request_id, error=exc.message, code=exc.code)
        yield b"data: " + orjson.dumps(exc.body()) + b"\n\n" if translator is None else translator.fail(exc)
    finally:
        await served.stream.aclose()
        ex.metered(meter)
        await ex.finish(status, error)
    if translator is None:
        yield b"data: [DONE]\n\n"


class Relay(StreamingResponse):
    """A stream whose upstream and bookkeeping are released however it ends, even when the
    client left before the first byte (then the relay generator never ran)."""

    def __init__(
        self, ex: Exchange, served: Served, headers: dict[str, str], body: AsyncGenerator[bytes, None]
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        self._ex, self._served = ex, served

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            assert isinstance(self.body_iterator, AsyncGenerator)  # the generator given: Starlette keeps it as is
            await self.body_iterator.aclose()
            assert self._served.stream is not None
            await self._served.stream.aclose()
            await self._ex.finish(499)  # a no-op when the relay already finished


def as_chunk(completion: Body) -> Body:
    """A whole chat completion as the one chunk a translator is fed."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    delta = {"content": message.get("content")} if message.get("content") else {}
    chunk = {"model": completion.get("model"), "choices": [{"index": 0, "delta": delta, "finish_reason": "stop"}]}
    return {**chunk, "usage": completion.get("usage")}
