"""A lean HTTP/1.1 client for the engines' OpenAI shape: kept-alive connections per origin,
responses parsed by httptools (llhttp, the parser uvicorn already runs for the gateway's own
side), TLS by the standard library's ``ssl``. It does what the ``openai`` backend asks of a
client and nothing more: one request at a time per connection, a body read whole or as it
arrives, no redirects, no cookies, no proxies, no compression (it asks for none).

Why not aiohttp's client: it was the largest single cost of a pass-through request (29% of the
gateway's samples, docs/benchmarks.md); this does the same work in a protocol object and a parser
callback per event. Failures are ``Broken`` (a ``ConnectionError``): refused, reset, closed
early, or an answer that is not HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import httptools

# Reading pauses while this much of a body waits unread (a stream the client reads slowly).
_HIGH_WATER = 1 << 20


class Broken(ConnectionError):
    """The connection failed, broke or carried something that is not an HTTP/1.1 answer."""

    refused = False  # nothing listens at the address (the connection was refused)


class Refused(Broken):
    refused = True


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def authority(self) -> str:
        default = 443 if self.scheme == "https" else 80
        return self.host if self.port == default else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Target:
    """A URL split once: where to connect and what to ask for."""

    origin: Origin
    path: str

    @classmethod
    def of(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(Origin(parts.scheme, parts.hostname, port), path)


class _Connection(asyncio.Protocol):
    """One kept-alive connection; the parser's callbacks fill the answer in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.origin: Origin | None = None  # set by the pool once connected: where it goes back
        self.closed = False
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._reset()

    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self._head: asyncio.Future[None] = self._loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.complete = False
        self.got_bytes = False
        self._error: Broken | None = None
        self._keep_alive = False
        self._until_close = False  # a body with neither a length nor chunks: it ends when the connection does

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Broken(f"the upstream's answer is not HTTP/1.1: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if self._until_close and self._head.done():
            self._finish()
            return
        what = "closed the connection" if exc is None else f"broke the connection ({exc})"
        self._fail(Broken(f"the upstream {what} before its answer ended"))

    def pause_writing(self) -> None:  # bodies are small and written at once; nothing waits on this
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._until_close = (
            "content-length" not in self.headers
            and "chunked" not in self.headers.get("transfer-encoding", "").lower()
            and self.status not in (204, 304)
            and not 100 <= self.status < 200
        )
        if 100 <= self.status < 200:  # an interim answer (100 Continue): the real one follows
            self.headers = {}
            return
        self._keep_alive = (
            self._parser.should_keep_alive() and not self._until_close
        )  # llhttp forgets it once the body ends
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not 100 <= self.status < 200:  # after an interim answer the parser reads the next one
            self._finish()

    # -- the answer --------------------------------------------------------------------------
    def _finish(self) -> None:
        self.complete = True
        if not self._head.done():
            self._head.set_result(None)
        self._wake()

    def _fail(self, error: Broken) -> None:
        if self._error is None:
            self._error = error
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # read here: a request cancelled meanwhile never will
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def send(self, data: list[bytes]) -> None:
        assert self.transport is not None
        self._reset()
        self.transport.writelines(data)

    async def head(self) -> None:
        await self._head

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body as it arrived, None at its end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return None
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered <= _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def reusable(self) -> bool:
        return self.complete and not self.closed and self._error is None and self._keep_alive

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


@dataclass(eq=False)
class Response:
    """An answer whose head has arrived; its body is read once, whole or in pieces. ``release``
    gives the connection back (or closes it when the body was not read to its end)."""

    status: int
    headers: dict[str, str]
    _conn: _Connection
    _pool: Pool
    _released: bool = field(default=False)

    def __del__(self) -> None:  # never released (a stream dropped before its first read): no socket left open
        if not self._released and not self._conn.closed:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                self._conn.close()

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self._conn.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self._conn.next_chunk()) is not None:
            yield chunk

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool.put_back(self._conn)


class Pool:
    """Kept-alive connections per origin, any number open at once (the backend's admission and
    the engines bound the concurrency); an idle connection older than ``idle_s`` is closed
    rather than reused, as the engine may be closing it at the same moment."""

    def __init__(self, *, connect_s: float, idle_s: float = 30.0, tls: ssl.SSLContext | None = None) -> None:
        self.connect_s = connect_s
        self.idle_s = idle_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._targets: dict[str, Target] = {}
        self._tls = tls  # None: the system's trusted authorities, made on the first https origin
        self._closed = False

    def target(self, url: str) -> Target:
        t = self._targets.get(url)
        if t is None:
            if len(self._targets) > 4096:
                self._targets.clear()
            t = self._targets[url] = Target.of(url)
        return t

    async def request(self, method: str, url: str, headers: dict[str, str], body: bytes | None = None) -> Response:
        """Send one request and wait for the answer's head. A kept-alive connection that the
        engine closed before answering (its idle timeout, or a restart) is retried once, on a new
        connection; the origin's other idle connections are dropped with it, as likely dead."""
        target = self.target(url)
        lines = [f"{method} {target.path} HTTP/1.1\r\nHost: {target.origin.authority}\r\n"]
        for k, v in headers.items():
            if "\n" in v or "\r" in v:  # a credential or a trace header that would split the request
                raise Broken(f"the {k} header's value holds a line break")
            lines.append(f"{k}: {v}\r\n")
        if body is not None or method == "POST":
            lines.append(f"Content-Length: {len(body or b'')}\r\n")
        lines.append("\r\n")
        data = ["".join(lines).encode("latin-1")] + ([body] if body else [])
        for attempt in range(2):
            conn, reused = await self._acquire(target.origin, fresh=attempt > 0)
            conn.send(data)
            try:
                await conn.head()
            except Broken:
                conn.close()
                if reused and not conn.got_bytes:
                    self._drop_idle(target.origin)
                    continue
                raise
            except BaseException:  # cancelled or timed out while waiting: the connection is in an unknown state
                conn.close()
                raise
            return Response(conn.status, conn.headers, conn, self)
        raise AssertionError("unreachable")  # the second try raises or returns

    async def _acquire(self, origin: Origin, *, fresh: bool = False) -> tuple[_Connection, bool]:
        if self._closed:
            raise Broken("the client is closed")
        idle = None if fresh else self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_s:
                return conn, True
            conn.close()
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(
                    _Connection, origin.host, origin.port, ssl=tls, server_hostname=origin.host if tls else None
                )
        except TimeoutError:
            raise Broken(f"connecting to {origin.authority} took more than {self.connect_s} s") from None
        except ConnectionRefusedError as exc:
            raise Refused(f"cannot connect to {origin.authority}: {exc}") from None
        except OSError as exc:  # unreachable, name not found, TLS refused
            raise Broken(f"cannot connect to {origin.authority}: {exc}") from None
        conn.origin = origin
        return conn, False

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _drop_idle(self, origin: Origin) -> None:
        for conn in self._idle.pop(origin, ()):
            conn.close()

    def put_back(self, conn: _Connection) -> None:
        if self._closed or conn.origin is None or not conn.reusable():
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.origin, []).append(conn)

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
