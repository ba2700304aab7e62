"""The OpenAI surface: chat and text completions (plain and SSE), models, health, metrics."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

import orjson
import structlog
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.routing import Route as HTTPRoute

from backends.base import Body, Kind
from gateway.http import anthropic_messages, responses
from gateway.http import openapi as openapi_doc
from gateway.http.app_state import GatewayState
from gateway.service import decide, embeddings, quotas, typed
from gateway.service import pipeline as flow
from gateway.service.dispatch import Served
from gateway.service.exchange import Exchange
from gateway.service.runtime import Runtime
from gateway.service.schemas import check, parse_any_json, parse_json
from policies import spend
from policies.cascade import CascadeExhausted, Decision
from policies.errors import (
    BudgetExhausted,
    ClientGone,
    InvalidRequest,
    KeyRateLimited,
    ModelNotFound,
    PayloadTooLarge,
    RequestTimeout,
    TriageError,
)
from policies.plans import public_models
from policies.schema import Limits
from policies.semantic import Route

router = APIRouter()
T = TypeVar("T")
log = structlog.get_logger("triage.api")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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


def route_headers(route: Route, switch: str | None) -> dict[str, str]:
    if switch in (None, "none", "always"):  # no switch, or one that cannot stop thinking
        reasoning = "unsupported"
    elif switch in ("client", "engine"):
        # client: the request set the switch itself; engine: the route leaves it to the engine's default
        reasoning = switch
    else:
        reasoning = "on" if route.reasoning else "off"
    headers = {
        "x-triage-route": route.reason + ("+follow_up" if route.follow_up else ""),
        "x-triage-reasoning": reasoning,
        "x-triage-confidence": f"{route.confidence:.4f}",
        "x-triage-category": route.category or "",
    }
    if (q := route.quality) is not None:  # the learned router: predicted P(right) and the expected cost
        headers["x-triage-quality"] = (
            f"chosen={q.quality:.4f} best={q.best_quality:.4f} strongest={q.strongest_quality:.4f}"
        )
        headers["x-triage-expected-cost"] = f"{q.cost:.8f}"
    if (rule := route.rule) is not None:  # "0 intents=transfer 0.9312": the rule, its head's answer (%-encoded)
        headers["x-triage-rule"] = f"{rule.index} {rule.head}={quote(rule.label)} {rule.confidence:.4f}"
    return headers


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


async def read_body(request: Request, limits: Limits, most: int | None = None) -> bytes:
    """The body, at most ``limits.max_body_bytes`` (or ``most``), within ``limits.body_timeout_s``
    (slowloris: a client that sends its headers and then stalls holds nothing but its socket,
    and not for long)."""
    limit = most if most is not None else limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body of {declared} bytes is over the limit of {limit} bytes")
    parts, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise PayloadTooLarge(f"Request body is over the limit of {limit} bytes")
                parts.append(part)
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {limits.body_timeout_s:g} s") from None
    except ClientDisconnect:
        raise ClientGone("the client closed the connection before its request body was in") from None
    return b"".join(parts)


async def _unless_gone(request: Request, work: Awaitable[T], every_s: float = 0.25) -> T:
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


def _state(request: Request) -> GatewayState:
    return request.app.state.triage


async def _authorize(request: Request, ex: Exchange) -> None:
    ex.key = await ex.rt.authenticate(request.headers.get("authorization"))


async def _admitted_body(request: Request, ex: Exchange) -> bytes:
    """The key checked, the body read, then a slot taken (only once the body is in: a slow
    sender holds no slot)."""
    await _authorize(request, ex)
    raw = await read_body(request, ex.rt.policy.limits)
    ex.take_slot()
    return raw


@dataclass
class Result:
    """What the pipeline gave for one chat or completion body, with the response headers."""

    headers: dict[str, str]
    served: Served | None = None
    typed: dict[str, Any] | None = None


async def pipeline(request: Request, ex: Exchange, kind: Kind, body: dict[str, Any]) -> Result:
    """:func:`gateway.service.pipeline.run` for one HTTP request: its bookkeeping in ``ex``, its headers."""
    ex.model = body.get("model") if isinstance(body.get("model"), str) else None
    ex.prompt = body.get("messages") if kind == "chat" else body.get("prompt")
    # a client that leaves is watched for only where a request can wait in a queue: A/B runs of
    # `bench overhead` hinted at 0.2 ms a request for watching every one (noisy, not settled)
    wait = (lambda work: _unless_gone(request, work)) if ex.rt.admission else None
    await quotas.admit(ex.rt, ex.key, ex.model)
    out = await flow.run(ex.rt, kind, body, ex.request_id, ex.attempts, wait=wait)
    ex.stream = out.stream
    if out.decision is not None:
        ex.decided(out.decision)
        return Result(decision_headers(ex, out.decision), typed=out.typed)
    served = out.served
    assert served is not None
    ex.route = served.route
    ex.served, ex.backend, ex.replica = served.model, served.backend, served.replica
    headers = {"x-request-id": ex.request_id, "x-triage-model": served.model, "x-triage-backend": served.backend}
    if served.route is not None:
        headers.update(route_headers(served.route, served.reasoning_switch))
        if served.model != served.route.model:  # the route's model failed: a fallback answered
            headers["x-triage-fallback-from"] = served.route.model
    if served.completion is not None:
        usage = served.completion.body.get("usage")
        ex.usage = usage if isinstance(usage, dict) else None
        ex.cost = spend.cost(ex.rt.policy.models[served.model].prices, ex.usage)
        headers["x-triage-cost"] = f"{ex.cost:.8f}"
    return Result(headers, served=served)


async def _generate(request: Request, kind: Kind) -> Response:
    state = _state(request)
    endpoint = "chat" if kind == "chat" else "completions"
    ex = Exchange.begin(state.holder, state.metrics, state.gate, endpoint, request.headers.get("x-request-id"))
    try:
        raw = await _admitted_body(request, ex)
        body = parse_json(raw)
        result = await pipeline(request, ex, kind, body)
        if result.typed is not None:
            await ex.finish(200)
            return _typed_response(result.typed, result.headers, bool(body.get("stream")))
        served = result.served
        assert served is not None
        if served.stream is not None:
            return _SSEResponse(ex, served, result.headers)  # it finishes the exchange when it ends
        assert served.completion is not None
        answer = served.completion.body
    except TriageError as exc:
        await ex.finish(exc.status, exc)
        return error_response(exc)
    except BaseException:
        await ex.finish(500)
        raise
    await ex.finish(200)
    return _json(answer, headers=result.headers)


def _typed_response(reply: dict[str, Any], headers: dict[str, str], stream: bool) -> Response:
    """A typed decision's chat completion, plain or as the stream of its chunks."""
    if not stream:
        return _json(reply, headers=headers)
    events = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in typed.chunks(reply)) + b"data: [DONE]\n\n"
    return Response(events, media_type="text/event-stream", headers={**_SSE_HEADERS, **headers})


def decision_headers(ex: Exchange, d: Decision) -> dict[str, str]:
    headers = {"x-request-id": ex.request_id, "x-triage-tier": d.tier, "x-triage-confidence": f"{d.confidence:.4f}"}
    headers["x-triage-cost"] = f"{ex.cost or 0.0:.8f}"
    if d.cached is not None:
        headers["x-triage-cache"] = "hit" if d.cached else "miss"
    return headers


async def _decide(request: Request, batch: bool) -> Response:
    state = _state(request)
    ex = Exchange.begin(
        state.holder,
        state.metrics,
        state.gate,
        "decide_batch" if batch else "decide",
        request.headers.get("x-request-id"),
    )
    try:
        await _authorize(request, ex)
        spec = decide.served_cascade(ex.rt)
        body = await read_body(request, ex.rt.policy.limits)
        ex.take_slot()  # only once the body is in: a slow sender holds no slot
        await quotas.admit(ex.rt, ex.key, None)
        decide.barred(ex.rt, spec, ex.key)  # 403 when the key may ask no tier
        raw = parse_any_json(body)
        if not batch:
            q, overrides = decide.parse_one(ex.rt, raw)
            ex.prompt = q.question
            work = decide.decide(ex.rt, q, overrides, ex.request_id, ex.attempts, ex.key)
            decision = await _unless_gone(request, work)
            ex.decided(decision)
            await ex.finish(200)
            return _json(decide.body(decision, ex.request_id), headers=decision_headers(ex, decision))
        answers = await _unless_gone(request, _decide_batch(ex, raw, spec, decide.known_tasks(ex.rt)))
    except TriageError as exc:
        await ex.finish(exc.status, exc)
        return error_response(exc)
    except BaseException:
        await ex.finish(500)
        raise
    await ex.finish(200)
    return _json(answers, headers={"x-request-id": ex.request_id, "x-triage-cost": f"{ex.cost or 0.0:.8f}"})


async def _decide_batch(ex: Exchange, raw: Any, spec: Any, tasks: set[str]) -> list[dict[str, Any]]:
    """Every question answered, in order; a bad or unanswerable one gets its own error entry."""
    items = raw.get("questions") if isinstance(raw, dict) else raw
    if not isinstance(items, list) or not items:
        raise InvalidRequest('the body must be a non-empty list of questions (or {"questions": [...]})')
    if len(items) > spec.max_batch:
        raise InvalidRequest(f"at most {spec.max_batch} questions per batch, not {len(items)}")
    parsed: list[Any] = []
    for item in items:
        try:
            parsed.append(decide.parse(item, spec, tasks))
        except InvalidRequest as exc:
            parsed.append(exc)
    good = [(i, p) for i, p in enumerate(parsed) if not isinstance(p, InvalidRequest)]
    results = await decide.decide_many(ex.rt, [p for _, p in good], ex.request_id, ex.attempts, ex.key)
    ex.decided(*(r for r in results if isinstance(r, Decision)))
    ex.charges += [
        c for r in results if isinstance(r, CascadeExhausted) for c in spend.trace_charges(ex.rt.policy.models, r.trace)
    ]
    ex.cost = sum(c for *_, c in ex.charges)
    answers: list[dict[str, Any]] = [p.body() if isinstance(p, InvalidRequest) else {} for p in parsed]
    for (i, _), result in zip(good, results, strict=True):
        rid = f"{ex.request_id}-{i}"
        answers[i] = result.body() if isinstance(result, TriageError) else decide.body(result, rid)  # type: ignore[arg-type]
    return answers


async def decide_one(request: Request) -> Response:
    return await _decide(request, batch=False)


async def decide_batch(request: Request) -> Response:
    return await _decide(request, batch=True)


async def _sse(ex: Exchange, served: Served) -> AsyncGenerator[bytes, None]:
    """Relay chunks; a failure after the stream started becomes an SSE error event, then [DONE]."""
    assert served.stream is not None
    status, error = 499, None  # until the upstream finishes, a stop is the client going away
    try:
        async for chunk in served.stream:
            chunk["model"] = served.model
            if chunk.get("usage"):
                ex.usage = chunk["usage"]
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        status = 200
    except TriageError as exc:
        status, error = exc.status, exc
        log.warning("stream_failed", request_id=ex.request_id, error=exc.message)
        yield b"data: " + orjson.dumps(exc.body()) + b"\n\n"
    finally:
        await served.stream.aclose()
        await ex.finish(status, error)
    yield b"data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """A stream whose upstream and bookkeeping are released however it ends, even when the
    client left before the first byte (then the relay generator never ran)."""

    def __init__(
        self, ex: Exchange, served: Served, headers: dict[str, str], events: AsyncGenerator[bytes, None] | None = None
    ) -> None:
        body = events if events is not None else _sse(ex, served)  # chat's chunks, or another API's events
        super().__init__(body, media_type="text/event-stream", headers={**_SSE_HEADERS, **headers})
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


async def embeddings_route(request: Request) -> Response:
    state = _state(request)
    ex = Exchange.begin(state.holder, state.metrics, state.gate, "embeddings", request.headers.get("x-request-id"))
    try:
        raw = await _admitted_body(request, ex)
        out = await _unless_gone(request, embeddings.answer(ex, raw))  # it admits the key for the model
    except TriageError as exc:
        await ex.finish(exc.status, exc)
        return error_response(exc)
    except BaseException:
        await ex.finish(500)
        raise
    await ex.finish(200)
    return _json(out, headers={"x-request-id": ex.request_id, "x-triage-model": out["model"]})


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``: translated to chat, through the same pipeline, translated back."""
    state = _state(request)
    ex = Exchange.begin(state.holder, state.metrics, state.gate, "responses", request.headers.get("x-request-id"))
    try:
        raw = await _admitted_body(request, ex)
        req = parse_json(raw)
        ex.model = req.get("model") if isinstance(req.get("model"), str) else None
        checked = check(responses.ResponsesRequest, req)
        owner, operator = _owner(ex.rt, request)
        earlier: list[Any] = []
        if checked.previous_response_id:
            before = state.responses.get(checked.previous_response_id, owner, operator)
            limit = ex.rt.policy.limits.max_body_bytes
            if before.size + len(raw) > limit:  # the conversation is sent upstream whole: it counts as the body
                raise InvalidRequest(
                    f"the conversation up to this turn is {before.size + len(raw)} bytes, over the "
                    f"{limit}-byte body limit: start a new one",
                    param="previous_response_id",
                )
            earlier = before.messages
        body, turns = responses.chat_body(req, earlier)
        result = await pipeline(request, ex, "chat", body)
        response_id = responses.new_id("resp")
        store = req.get("store", True) is not False
        if result.typed is not None or (result.served is not None and result.served.completion is not None):
            completion = result.typed if result.typed is not None else result.served.completion.body  # type: ignore[union-attr]
            out, turn = responses.from_chat(req, response_id, completion)
            if store:
                state.responses.put(out, [*turns, turn], owner)
            if body.get("stream"):  # a whole answer (a typed decision) as the event sequence
                translator = responses.StreamTranslator(req, response_id, out["model"])
                events = translator.start() + translator.feed(_as_chunk(completion)) + translator.finish()[0]
                await ex.finish(200)
                return Response(events, media_type="text/event-stream", headers={**_SSE_HEADERS, **result.headers})
            await ex.finish(200)
            return _json(out, headers=result.headers)
        assert result.served is not None and result.served.stream is not None
        keep = (lambda out, turn: state.responses.put(out, [*turns, turn], owner)) if store else None
        translator = responses.StreamTranslator(req, response_id, result.served.model, keep)
        stream = _translated(ex, result.served, translator)
        return _SSEResponse(ex, result.served, result.headers, stream)  # it finishes the exchange when it ends
    except TriageError as exc:
        await ex.finish(exc.status, exc)
        return error_response(exc)
    except BaseException:
        await ex.finish(500)
        raise


def _as_chunk(completion: dict[str, Any]) -> dict[str, Any]:
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    delta = {"content": message.get("content")} if message.get("content") else {}
    chunk = {"model": completion.get("model"), "choices": [{"index": 0, "delta": delta, "finish_reason": "stop"}]}
    return {**chunk, "usage": completion.get("usage")}


class Translator(Protocol):
    """Chat chunks in, another API's events out (``responses.StreamTranslator``, Anthropic's)."""

    def start(self) -> bytes: ...
    def feed(self, chunk: dict[str, Any]) -> bytes: ...
    def end(self) -> bytes: ...
    def fail(self, exc: TriageError) -> bytes: ...


async def _translated(ex: Exchange, served: Served, translator: Translator) -> AsyncGenerator[bytes, None]:
    """Another API's event stream over a chat stream: a failure after the start is that API's
    error event; the exchange finishes however the stream ends."""
    assert served.stream is not None
    status, error = 499, None
    try:
        yield translator.start()
        async for chunk in served.stream:
            if chunk.get("usage"):
                ex.usage = chunk["usage"]
            data = translator.feed(chunk)
            if data:
                yield data
        status = 200
        yield translator.end()
    except TriageError as exc:
        status, error = exc.status, exc
        log.warning("stream_failed", request_id=ex.request_id, error=exc.message)
        yield translator.fail(exc)
    finally:
        await served.stream.aclose()
        await ex.finish(status, error)


async def create_message(request: Request) -> Response:
    """``POST /v1/messages`` (Anthropic): translated to chat, the same pipeline, translated back;
    errors in Anthropic's shape; the key in ``x-api-key`` (or ``Authorization: Bearer``)."""
    state = _state(request)
    ex = Exchange.begin(state.holder, state.metrics, state.gate, "messages", request.headers.get("x-request-id"))
    try:
        key = request.headers.get("x-api-key")
        sent = request.headers.get("authorization") or (f"Bearer {key}" if key else None)
        ex.key = await ex.rt.authenticate(sent, send="x-api-key: <key>")
        raw = await read_body(request, ex.rt.policy.limits)
        ex.take_slot()  # only once the body is in: a slow sender holds no slot
        req = parse_json(raw)
        ex.model = req.get("model") if isinstance(req.get("model"), str) else None
        body = anthropic_messages.chat_body(req)
        result = await pipeline(request, ex, "chat", body)
        served = result.served
        if result.typed is not None or (served is not None and served.stream is None):
            completion = result.typed if result.typed is not None else served.completion.body  # type: ignore[union-attr]
            await ex.finish(200)
            if body.get("stream"):  # a whole answer (a typed decision) as the event sequence
                t = anthropic_messages.StreamTranslator(str(completion.get("model", "")))
                events = t.start() + t.feed(_as_chunk(completion)) + t.finish()
                return Response(events, media_type="text/event-stream", headers={**_SSE_HEADERS, **result.headers})
            return _json(anthropic_messages.from_chat(completion), headers=result.headers)
        assert served is not None and served.stream is not None
        translator = anthropic_messages.StreamTranslator(served.model)
        return _SSEResponse(ex, served, result.headers, _translated(ex, served, translator))
    except TriageError as exc:
        await ex.finish(exc.status, exc)
        return error_response(exc, "/v1/messages")
    except BaseException:
        await ex.finish(500)
        raise


def _owner(rt: Runtime, request: Request) -> tuple[str | None, bool]:
    """Who a stored object belongs to (the key's sha256; None without keys), and whether that key
    is an operator's (it sees every key's)."""
    if not rt.keys_required:
        return None, False
    owner = rt.key_digest(request.headers.get("authorization"))
    return owner, owner in rt.operator_hashes


async def get_response(request: Request) -> Response:
    return await _stored(request, "get")


async def delete_response(request: Request) -> Response:
    return await _stored(request, "delete")


async def _stored(request: Request, action: str) -> Response:
    state = _state(request)
    rt = state.holder.current
    response_id = request.path_params["response_id"]
    try:
        await rt.authenticate(request.headers.get("authorization"))
        owner, operator = _owner(rt, request)
        if action == "delete":
            state.responses.delete(response_id, owner, operator)
            return _json({"id": response_id, "object": "response.deleted", "deleted": True})
        return _json(state.responses.get(response_id, owner, operator).response)
    except TriageError as exc:
        return error_response(exc)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


# The hot paths are plain Starlette routes: they read the raw body themselves, so FastAPI's
# dependency solving would only add time (measured by `python -m benchmarks overhead`).
HOT_ROUTES = [
    HTTPRoute("/v1/chat/completions", chat_completions, methods=["POST"]),
    HTTPRoute("/v1/completions", completions, methods=["POST"]),
    HTTPRoute("/v1/decide", decide_one, methods=["POST"]),
    HTTPRoute("/v1/decide/batch", decide_batch, methods=["POST"]),
    HTTPRoute("/v1/embeddings", embeddings_route, methods=["POST"]),
    HTTPRoute("/v1/responses", create_response, methods=["POST"]),
    HTTPRoute("/v1/messages", create_message, methods=["POST"]),
    HTTPRoute("/v1/responses/{response_id}", get_response, methods=["GET"]),
    HTTPRoute("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
]


def _model_card(name: str) -> Body:
    return {"id": name, "object": "model", "created": 0, "owned_by": "triage"}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    rt = _state(request).holder.current
    await rt.authenticate(request.headers.get("authorization"))
    names = [*public_models(rt.policy), *embeddings.served_models(rt)]
    return _json({"object": "list", "data": [_model_card(m) for m in names]})


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str) -> Response:
    rt = _state(request).holder.current
    await rt.authenticate(request.headers.get("authorization"))
    if model not in public_models(rt.policy) and model not in embeddings.served_models(rt):
        return error_response(ModelNotFound(f"The model '{model}' does not exist", param="model"))
    return _json(_model_card(model))


@router.get("/health")
async def health() -> Response:
    return _json({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    rt = _state(request).holder.current
    backends = {name: b.healthy() for name, b in rt.backends.items()}
    # ready when every model can be served: its own backend, or one of its fallbacks', is up
    down = [
        name
        for name, spec in rt.policy.models.items()
        if not any(backends.get(rt.policy.models[m].backend, False) for m in [name, *spec.fallbacks])
    ]
    ok = bool(backends) and not down
    body: dict[str, Any] = {"status": "ready" if ok else "not_ready", "backends": backends}
    problems = {name: p for name, b in rt.backends.items() if not backends[name] and (p := _problem(b))}
    if problems:  # a local engine's reason: it does not load, or its worker is restarting
        body["problems"] = problems
    if rt.store_problem is not None and not await quotas.recovered(rt):  # serving, limited keys refused (503)
        body["state"] = {"store": rt.policy.state.store, "degraded": True}  # why: the log's state_store_down
        body["status"] = "degraded" if ok else body["status"]
    return _json(body, 200 if ok else 503)


def _problem(backend: Any) -> str | None:
    problem = getattr(backend, "problem", None)
    return problem() if callable(problem) else None


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    rt = _state(request).holder.current
    if not rt.policy.access.public_metrics:
        await rt.authenticate(request.headers.get("authorization"))  # a scraper without one: access.public_metrics
    return Response(_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> Response:
    """The OpenAPI document, behind the key like the API it describes."""
    rt = _state(request).holder.current
    await rt.authenticate(request.headers.get("authorization"))
    keys, public = rt.keys_required, rt.policy.access.public_metrics
    doc = openapi_doc.document_bytes(request.app.title, request.app.version, keys, public)
    return Response(doc, media_type="application/json")
