"""The ``openai`` backend: any OpenAI-compatible engine (vLLM, SGLang, llama.cpp server),
called over one pool of kept-alive HTTP/1.1 connections (backends.http1). The lean path: no SDK
in between, JSON by orjson.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

import orjson

from backends.base import Body, Call
from backends.http1 import Pool, Response
from backends.remote import RemoteBackend, upstream_failure
from backends.replicas import ReplicaState
from policies.errors import InvalidRequest, UpstreamError

_PATHS = {"chat": "/chat/completions", "completion": "/completions", "embedding": "/embeddings"}
# W3C trace context (traceparent, tracestate) for the calls made now: set by gateway.obs.tracing around one
# upstream call of a traced request, sent with each try
TRACE_HEADERS: ContextVar[dict[str, str] | None] = ContextVar("triage_trace_headers", default=None)


class OpenAICompatBackend(RemoteBackend):
    def __init__(self, name: str, spec: Any) -> None:
        super().__init__(name, spec)
        self._pool: Pool | None = None
        self._listing: asyncio.Future[dict[str, int]] | None = None  # a GET /models in flight (context_length)

    async def start(self) -> None:
        self._pool = Pool(connect_s=self.spec.timeouts.connect_s)
        await super().start()

    async def close(self) -> None:
        await super().close()
        if self._pool is not None:
            await self._pool.close()

    def _headers(self, replica: ReplicaState) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if replica.api_key:
            headers["Authorization"] = f"Bearer {replica.api_key}"
        if (trace := TRACE_HEADERS.get()) is not None:
            headers.update(trace)
        return headers

    async def _post(self, replica: ReplicaState, call: Call) -> Response:
        assert self._pool is not None, "backend not started"
        url = replica.api_base + _PATHS[call.kind]
        try:
            data = orjson.dumps(call.body)
        except orjson.JSONEncodeError as exc:  # the edge bounds nesting; this is the backstop
            raise InvalidRequest(f"The request cannot be sent on: {exc}", code="nested_too_deep") from None
        try:
            resp = await self._pool.request("POST", url, self._headers(replica), data)
        except ConnectionError as exc:
            raise UpstreamError(f"cannot reach upstream {self.name}", detail=str(exc)) from None
        if resp.status >= 400:
            try:
                raw = await _read(resp, self.name)
            finally:
                resp.release()
            message, code = _error_of(raw, resp.status)
            failure = upstream_failure(self.name, resp.status, message, code, self.spec.error_text)
            if isinstance(failure, UpstreamError) and resp.status in (429, 503):
                failure.retry_after_s = retry_after(resp.headers.get("retry-after"))
            raise failure
        return resp

    async def _call_once(self, replica: ReplicaState, call: Call) -> Body:
        resp = await self._post(replica, call)
        try:
            raw = await _read(resp, self.name)
        finally:
            resp.release()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(f"upstream {self.name} sent a body that is not JSON") from None
        if not isinstance(body, dict):
            raise UpstreamError(f"upstream {self.name} sent JSON that is not an object")
        return body

    async def _open_once(self, replica: ReplicaState, call: Call) -> AsyncIterator[Body]:
        resp = await self._post(replica, call)
        return _sse_events(resp, self.name)

    async def context_length(self, upstream: str) -> int | None:
        """``max_model_len`` of ``upstream`` in the first replica's ``GET /models`` (vLLM and SGLang
        say it; llama.cpp's server and hosted APIs do not: None). The models a backend serves are
        asked at once at start-up: their calls share one ``GET /models`` while it is in flight."""
        if self._listing is None:
            self._listing = asyncio.ensure_future(self._models())
            self._listing.add_done_callback(lambda _: setattr(self, "_listing", None))
        return (await asyncio.shield(self._listing)).get(upstream)

    async def _models(self) -> dict[str, int]:
        """Each listed model's ``max_model_len``, where the engine says it."""
        assert self._pool is not None, "backend not started"
        replica = self.replicas.replicas[0]
        try:
            async with asyncio.timeout(self.spec.timeouts.connect_s + 5):
                resp = await self._pool.request("GET", replica.api_base + "/models", self._headers(replica))
                try:
                    if resp.status >= 400:
                        return {}
                    listed = orjson.loads(await resp.read())
                finally:
                    resp.release()
        except (ConnectionError, TimeoutError, orjson.JSONDecodeError):
            return {}
        cards = listed.get("data") if isinstance(listed, dict) else None
        return {
            str(card.get("id")): value
            for card in (cards if isinstance(cards, list) else [])
            if isinstance(card, dict)
            and isinstance(value := card.get("max_model_len"), int)
            and not isinstance(value, bool)
            and value > 0
        }

    async def _probe(self, replica: ReplicaState) -> bool:
        assert self._pool is not None
        health = self.spec.health
        url = (server_root(replica.api_base) if health.base == "server" else replica.api_base) + health.path
        try:
            resp = await self._pool.request("GET", url, self._headers(replica))
            try:
                await resp.read()
            finally:
                resp.release()
        except ConnectionError:
            return False
        return resp.status < 400

    async def _fetch(self, replica: ReplicaState, path: str) -> tuple[int, str, bytes]:
        assert self._pool is not None, "backend not started"
        resp = await self._pool.request("GET", server_root(replica.api_base) + path, self._headers(replica))
        try:
            body = await resp.read()
        finally:
            resp.release()
        return resp.status, resp.headers.get("content-type", ""), body


def retry_after(value: str | None) -> float | None:
    """A ``retry-after`` header's seconds (the delay form; an HTTP date is not read), at most an hour."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return min(seconds, 3600.0) if seconds is not None and seconds >= 0 and seconds == seconds else None


def server_root(api_base: str) -> str:
    """``http://host:port`` of an api_base such as ``http://host:port/v1``."""
    parts = urlsplit(api_base)
    return f"{parts.scheme}://{parts.netloc}"


async def _read(resp: Response, name: str) -> bytes:
    try:
        return await resp.read()
    except ConnectionError as exc:
        raise UpstreamError(f"upstream {name}'s connection broke", detail=str(exc)) from None


def _error_of(raw: bytes, status: int) -> tuple[str, str | None]:
    try:
        err = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:300].decode("utf-8", "replace") or f"HTTP {status}", None
    inner = err.get("error", err) if isinstance(err, dict) else err
    if isinstance(inner, dict):
        return str(inner.get("message") or inner.get("detail") or inner), inner.get("code")
    return str(inner), None


async def _sse_events(resp: Response, name: str) -> AsyncIterator[Body]:
    """Parse an OpenAI SSE stream into chunk bodies; a stream that ends early is an error."""
    buf = b""
    finished = False
    try:
        async for block in resp.iter_chunks():
            buf += block
            while True:
                nl = buf.find(b"\n")
                if nl < 0:
                    break
                line, buf = buf[:nl].strip(), buf[nl + 1 :]
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    raise UpstreamError(f"upstream {name} sent a malformed stream event") from None
                if not isinstance(chunk, dict) or not all(isinstance(c, dict) for c in chunk.get("choices") or ()):
                    raise UpstreamError(f"upstream {name} sent a stream event that is not a chunk", retryable=False)
                if chunk.get("error"):
                    message, _ = _error_of(data, 502)
                    raise UpstreamError(f"upstream {name} failed mid-stream", retryable=False, detail=message)
                finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or ())
                yield chunk
    except ConnectionError as exc:
        raise UpstreamError(f"upstream {name}'s stream broke", retryable=False, detail=str(exc)) from None
    finally:
        resp.release()
    if not finished:
        raise UpstreamError(f"upstream {name} ended the stream early", retryable=False)


def factory(name: str, spec: Any) -> OpenAICompatBackend:
    return OpenAICompatBackend(name, spec)
