"""The edge's one exchange: :func:`door` wraps a route so that it owns, in this order, the key,
the body (bounded in size and time), the concurrency slot (once the body is in: a slow sender
holds none), the key's model and limits, the bookkeeping and the error in the API's own shape.
A route's handler only reads the body and answers; it raises, never renders an error.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from fastapi import Request, Response

from gateway.http import anthropic_messages
from gateway.http.app_state import GatewayState
from gateway.http.exchange import Exchange
from gateway.http.relay import Relay
from gateway.service.bodies import parse_any_json, parse_json
from gateway.service.context import Context
from gateway.service.keys import quotas
from gateway.service.runtime import Runtime
from policies.errors import BudgetExhausted, ClientGone, KeyRateLimited, PayloadTooLarge, RequestTimeout, TriageError
from policies.response_cache import directive
from policies.schema import ApiKey, Limits

T = TypeVar("T")
ANTHROPIC_PATHS = frozenset({"/v1/messages"})  # whose errors are in Anthropic's shape


def error_response(exc: TriageError, path: str | None = None) -> Response:
    """The error in the API's own shape: OpenAI's, or Anthropic's on its paths."""
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    if isinstance(exc, KeyRateLimited | BudgetExhausted):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        if isinstance(exc, BudgetExhausted):  # the official clients retry a 429 unless told not to
            headers["x-should-retry"] = "false"
    if exc.status in (408, 413):  # the rest of the body is not read: the connection cannot be reused
        headers = {"Connection": "close"}
    body = anthropic_messages.error_body(exc) if path in ANTHROPIC_PATHS else exc.body()
    return Response(orjson.dumps(body), status_code=exc.status, media_type="application/json", headers=headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


async def read_body(request: Request, limits: Limits, most: int | None = None) -> bytes:
    """The body, at most ``limits.max_body_bytes`` (or ``most``), within ``limits.body_timeout_s``
    (slowloris: a client that sends its headers and then stalls holds nothing but its socket,
    and not for long)."""
    limit = most if most is not None else limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body of {declared} bytes is over the limit of {limit} bytes")
    parts, size, receive = [], 0, request.receive  # ASGI's messages, not Starlette's stream (issue 35)
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone("the client closed the connection before its request body was in")
                part = message.get("body", b"")
                size += len(part)
                if size > limit:
                    raise PayloadTooLarge(f"Request body is over the limit of {limit} bytes")
                parts.append(part)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {limits.body_timeout_s:g} s") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def unless_gone(request: Request, work: Awaitable[T], every_s: float = 0.25) -> T:
    """``work``, stopped if the client disconnects first: a request waiting for a replica slot, or
    for an unstreamed answer, ends when nobody waits for it. The check starts after ``every_s``
    and repeats (a timer, not a task: nothing on the fast path)."""
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    assert me is not None
    state: dict[str, Any] = {"gone": False, "timer": None}

    async def check() -> None:
        if await request.is_disconnected():
            state["gone"] = True
            me.cancel()
        else:
            state["timer"] = loop.call_later(every_s, start)

    def start() -> None:
        state["timer"] = loop.create_task(check())

    state["timer"] = loop.call_later(every_s, start)
    try:
        return await work
    except asyncio.CancelledError:
        if state["gone"]:
            me.uncancel()
            raise ClientGone("the client closed the connection before the answer was ready") from None
        raise
    finally:
        state["timer"].cancel()


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.triage


@dataclass
class Call:
    """What a handler behind a door gets: the request, its exchange, the raw body and its JSON."""

    request: Request
    ex: Exchange
    raw: bytes
    body: Any
    served: Any = None  # what the door's ``served`` check gave (a decision's plan), made once

    def wait(self, work: Awaitable[T]) -> Awaitable[T]:
        """``work`` stopped when the client leaves (where a request can wait in a queue: A/B runs of
        `bench overhead` hinted at 0.2 ms a request for watching every one, so only then)."""
        return unless_gone(self.request, work)

    def context(self, always: bool = False) -> Context:
        """The service's context; it watches for a client that leaves where a request can queue (a
        waiting room, a local engine's turn: an abandoned plain request gives the model back at
        once, as a stream does) or ``always`` (a decision, which may ask several tiers)."""
        watch = always or self.ex.rt.admission or self.ex.rt.local_engines
        ctx = self.ex.context(self.wait if watch else None)
        ctx.session = self.request.headers.get("x-session-id")
        if self.ex.rt.policy.response_cache is not None:
            ctx.cache = directive(self.request.headers.get("x-triage-cache"))
        return ctx


Handler = Callable[[Call], Awaitable[Response]]


def _credentials(request: Request, anthropic: bool) -> tuple[str | None, str]:
    """The Authorization value (on Anthropic's door, ``x-api-key`` too) and how to send the key."""
    if not anthropic:
        return request.headers.get("authorization"), "Authorization: Bearer <key>"
    key = request.headers.get("x-api-key")
    return request.headers.get("authorization") or (f"Bearer {key}" if key else None), "x-api-key: <key>"


AFTER = "triage.after"  # the scope's list of steps the edge runs once the answer is sent


async def after_answer(request: Request, ex: Exchange, status: int, error: TriageError | None = None) -> None:
    """The exchange's bookkeeping (metrics, console ring, spend), run by the edge once the answer's
    last byte is written (:data:`AFTER`), so the client has it while the gateway counts (issue 35).
    It runs in the same task before it yields: the gateway reads no other request in between, so
    /metrics and the console see it as before. At once instead where it writes a log event (read out
    of band: a request's line is written before its answer), or without an edge (a door alone)."""
    after = request.scope.get(AFTER)
    if after is None or ex.logs_event(status):
        await ex.finish(status, error)
    else:
        after.append(lambda: ex.finish(status, error))


def door(
    endpoint: str,
    *,
    any_json: bool = False,
    anthropic: bool = False,
    served: Callable[[Runtime, ApiKey | None], object] | None = None,
) -> Callable[[Handler], Callable[[Request], Awaitable[Response]]]:
    """A route behind the one exchange. ``any_json``: the body may be any JSON value (else an
    object); ``anthropic``: the key may come in ``x-api-key`` and errors are in Anthropic's shape;
    ``served``: raises when the policy does not serve this route to this key (asked before the
    body is read); what it returns is the call's ``served`` (a decision's plan: made once)."""

    def wrap(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            state = gateway_state(request)
            ex = Exchange.begin(state.holder, state.metrics, state.gate, endpoint, request.headers.get("x-request-id"))
            try:
                ex.key = await ex.rt.authenticate(*_credentials(request, anthropic))
                plan = served(ex.rt, ex.key) if served is not None else None
                raw = await read_body(request, ex.rt.policy.limits)
                ex.take_slot()
                body = parse_any_json(raw) if any_json else parse_json(raw)
                model = body.get("model") if isinstance(body, dict) else None
                ex.model = model if isinstance(model, str) else None
                await quotas.admit(ex.rt, ex.key, ex.model)  # the key's models and limits, at every door
                response = await handler(Call(request, ex, raw, body, plan))
            except TriageError as exc:
                await after_answer(request, ex, exc.status, exc)
                failed = error_response(exc, request.url.path)
                failed.headers["x-request-id"] = ex.request_id  # an error is found by its id as an answer is
                return failed
            except BaseException:
                await ex.finish(500)
                raise
            if not isinstance(response, Relay):  # a relay finishes the exchange when its stream ends
                await after_answer(request, ex, 200)
            return response

        route.__name__ = route.__qualname__ = handler.__name__
        route.__doc__ = handler.__doc__
        return route

    return wrap
