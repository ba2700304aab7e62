"""The server's own guards on connections, before a request exists: a connection must finish its
request's headers within ``limits.header_timeout_s`` (else 408 and closed: slowloris holds a
socket for seconds, not forever), and at most ``limits.max_connections`` are open at once (one
more is answered 503 and closed at once, so the process never runs out of file descriptors
for its engines, stores and files). uvicorn has neither: its HTTP protocol is extended here.

The same protocol sends an answer's head and body in one write (:class:`Coalesced`): uvicorn
writes them apart, two send calls and two TCP segments on a socket without Nagle's delay.

Read at start (``triage serve``, each worker of ``--workers N``); a reload does not change them.
"""

from __future__ import annotations

import asyncio
import resource
import time
from http import HTTPStatus
from typing import Any

import orjson
import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from policies.errors import RequestTimeout, TooManyConnections, TriageError
from policies.schema import Limits

log = structlog.get_logger("triage.connections")
FD_RESERVE = 256  # descriptors kept for what is not a client: engines, stores, files, upstream connections
LOG_EVERY_S = 1.0  # one log event per reason and second at most, with the count since the last


def _raw(exc: TriageError) -> bytes:
    body = orjson.dumps(exc.body())
    head = f"HTTP/1.1 {exc.status} {HTTPStatus(exc.status).phrase}\r\n"
    return (
        head.encode()
        + b"content-type: application/json\r\nconnection: close\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )


class _Tally:
    """Counts of a noisy event, logged at most every ``LOG_EVERY_S``."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.last: dict[str, float] = {}

    def add(self, event: str, **fields: Any) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1
        now = time.monotonic()
        if now - self.last.get(event, 0.0) >= LOG_EVERY_S:
            log.warning(event, count=self.counts.pop(event), **fields)
            self.last[event] = now


def cap(wanted: int) -> int:
    """``wanted`` connections, within what the process may open: the soft descriptor limit is
    raised to the hard one, and the cap kept ``FD_RESERVE`` below it (said in the log)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or wanted <= soft - FD_RESERVE:
        return wanted
    got = max(16, soft - FD_RESERVE)
    log.warning("max_connections_lowered", wanted=wanted, allowed=got, nofile=soft)
    return got


class Coalesced:
    """A connection's transport whose writes of one event-loop turn go out as one: the first is
    held until the next (joined and written at once) or the turn's end (``call_soon``), whichever
    comes first. uvicorn writes an answer's head when the app starts it and its body apart; both
    come in the same turn, so a whole answer is one send call. Closing sends what is held first;
    everything else is the transport's own."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is None:
            self._held = data
            self._loop.call_soon(self.flush)
        else:
            self._held = None
            self._transport.write(b"".join((held, data)))

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded(header_timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the two guards (a class per server: no shared state)."""
    timed_out = _raw(RequestTimeout(f"the request's headers did not arrive within {header_timeout_s:g} s"))
    busy = _raw(TooManyConnections(f"the gateway holds its {max_connections} connections: retry shortly"))
    tally = _Tally()

    class Guarded(HttpToolsProtocol):
        _late: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(Coalesced(transport, self.loop))  # type: ignore[arg-type]
            if len(self.connections) > max_connections:
                tally.add("connection_refused", open=len(self.connections), max_connections=max_connections)
                transport.write(busy)
                transport.close()
                return
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # each request on a kept-alive connection has the same time for its headers

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._late is None:
                self._late = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._late is not None:
                self._late.cancel()
                self._late = None

        def _too_slow(self) -> None:
            self._late = None
            if not self.transport.is_closing():
                tally.add("header_timeout", header_timeout_s=header_timeout_s)
                self.transport.write(timed_out)
                self.transport.close()

    return Guarded


def uvicorn_options(options: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """``options`` for uvicorn with the guarded protocol in place of httptools."""
    return {**options, "http": guarded(limits.header_timeout_s, cap(limits.max_connections))}
