"""OpenTelemetry tracing: a server span per HTTP request, a span per cascade decision and per tier it
asked, a client span per model called upstream and a span per replica try; exported by OTLP/HTTP
when an endpoint is configured (the policy's ``tracing.otlp_endpoint``, else the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``), off otherwise.

Off, each hook costs one context-variable read and the SDK is never imported (only the API, which
FastAPI imports anyway). On, the provider is the app's own, never the global one: FastAPI's native
telemetry (which reads the global provider) stays off, and two apps in one process do not share it.
Spans carry names, models, tiers, counts, timings and the key's *name*: never a key, a prompt or an
answer. Batch jobs run outside any request and are not traced.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from backends.base import Attempt, Call
from backends.openai_compat import TRACE_HEADERS
from policies.cascade import Ask, CascadeExhausted, Decision, Question, Step, TierAnswer
from policies.errors import TriageError
from policies.schema import TracingSpec

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = structlog.get_logger("triage.tracing")
T = TypeVar("T")

_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent / tracestate, nothing read from the environment
_UNTRACED = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes: no span
_OPERATIONS = {"chat": "chat", "completion": "text_completion", "embedding": "embeddings"}  # gen_ai.operation.name
_ENDPOINT_OPERATIONS = {"chat": "chat", "responses": "chat", "messages": "chat", "completions": "text_completion"}

# The tracer and the span that new spans of this request hang under (the request's, a tier's);
# None outside a traced request. The server span itself, for the exchange's attributes.
_SCOPE: ContextVar[tuple[Tracer, Context] | None] = ContextVar("triage_trace_scope", default=None)
_REQUEST: ContextVar[Span | None] = ContextVar("triage_request_span", default=None)


def export_endpoint(spec: TracingSpec, environ: Mapping[str, str]) -> str | None:
    """The OTLP/HTTP traces URL: the policy's, else the environment's; None: tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    if spec.otlp_endpoint:
        return _traces_url(spec.otlp_endpoint)
    if url := environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return url  # the signal's own variable is a full URL
    if base := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return _traces_url(base)
    return None


def _traces_url(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


class Tracing:
    """The app's tracer: started from the policy and the environment when the app starts, closed
    (its last spans flushed) when it stops; ``tracer`` is None while tracing is off."""

    def __init__(self) -> None:
        self.tracer: Tracer | None = None
        self._provider: TracerProvider | None = None

    def start(self, spec: TracingSpec, environ: Mapping[str, str] | None = None) -> bool:
        env = os.environ if environ is None else environ
        endpoint = export_endpoint(spec, env)
        if endpoint is None:
            return False
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        service = spec.service_name or env.get("OTEL_SERVICE_NAME") or "triage"
        provider = TracerProvider(
            resource=Resource.create({"service.name": service}),
            sampler=ParentBased(TraceIdRatioBased(spec.sample_ratio)),
            shutdown_on_exit=False,  # close() flushes, when the app stops
        )
        # batched, in the processor's thread: a slow or unreachable collector never holds a request
        # (it logs, and spans past the queue are dropped); OTEL_EXPORTER_OTLP_HEADERS add headers
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint, timeout=spec.export_timeout_s)))
        self._provider, self.tracer = provider, provider.get_tracer("triage")
        where = endpoint.split("://", 1)[-1].split("@")[-1].split("/")[0]  # the host: no credentials in the log
        log.info("tracing_started", collector=where, service=service, sample_ratio=spec.sample_ratio)
        return True

    def close(self) -> None:
        """Export what is left (within the export timeout) and stop; blocking: call it in a thread."""
        provider, self._provider, self.tracer = self._provider, None, None
        if provider is not None:
            provider.shutdown()


class Middleware:
    """ASGI: the server span of each HTTP request, continuing the caller's ``traceparent``."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = self.tracing.tracer
        if tracer is None or scope["type"] != "http" or scope["path"] in _UNTRACED:
            await self.app(scope, receive, send)
            return
        await _traced_request(self.app, tracer, scope, receive, send)


async def _traced_request(app: ASGIApp, tracer: Tracer, scope: Scope, receive: Receive, send: Send) -> None:
    method = scope["method"]
    parent = _PROPAGATOR.extract(_trace_headers(scope))
    span = tracer.start_span(method, parent, SpanKind.SERVER, attributes=_http_attributes(scope))
    here = trace.set_span_in_context(span, parent)
    sampled = span.is_recording()  # not sampled: no span below it, only the trace context sent upstream
    tokens = (
        otel_context.attach(here),
        _SCOPE.set((tracer, here) if sampled else None),
        _REQUEST.set(span if sampled else None),
        TRACE_HEADERS.set(None if sampled else _context_headers(here)),
    )
    status = 0

    async def watch(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)

    try:
        await app(scope, receive, watch)
    except BaseException as exc:
        span.set_attribute("error.type", type(exc).__qualname__)
        span.set_status(StatusCode.ERROR)
        raise
    finally:
        TRACE_HEADERS.reset(tokens[3])
        _REQUEST.reset(tokens[2])
        _SCOPE.reset(tokens[1])
        otel_context.detach(tokens[0])
        route = _route(scope)
        if route is not None:
            span.update_name(f"{method} {route}")
            span.set_attribute("http.route", route)
        if status:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_attribute("error.type", str(status))
                span.set_status(StatusCode.ERROR)
        span.end()


def _context_headers(ctx: Context) -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the span current in ``ctx``, as sent upstream."""
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers, ctx)
    return headers


def _trace_headers(scope: Scope) -> dict[str, str]:
    return {
        k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in (b"traceparent", b"tracestate")
    }


def _http_attributes(scope: Scope) -> dict[str, Any]:
    out: dict[str, Any] = {
        "http.request.method": scope["method"],
        "url.path": scope["path"],
        "url.scheme": scope.get("scheme", "http"),
    }
    if version := scope.get("http_version"):
        out["network.protocol.version"] = version
    if server := scope.get("server"):
        out["server.address"], out["server.port"] = server[0], server[1]
    if client := scope.get("client"):
        out["client.address"] = client[0]
    for k, v in scope["headers"]:
        if k == b"user-agent":
            out["user_agent.original"] = v.decode("latin-1")
    return out


def _route(scope: Scope) -> str | None:
    """The matched route's path template (``/v1/responses/{response_id}``), for a name of few values."""
    endpoint, app = scope.get("endpoint"), scope.get("app")
    if endpoint is None or app is None:
        return None
    for route in app.router.routes:
        if getattr(route, "endpoint", None) is endpoint:
            return str(route.path)
    return None


def recording() -> bool:
    """Whether this request has a span to annotate."""
    return _REQUEST.get() is not None


def annotate(event: Mapping[str, Any]) -> None:
    """The request's bookkeeping (the exchange's log event) on its server span: the key's name,
    the models, tokens, cost, the decision; never the prompt or a key."""
    span = _REQUEST.get()
    if span is None:
        return
    usage_in, usage_out = event.get("prompt_tokens"), event.get("completion_tokens")
    error = event.get("error") or {}
    route = event.get("route") or {}
    decision = event.get("decision") or {}
    values: dict[str, Any] = {
        "triage.request_id": event.get("request_id"),
        "triage.endpoint": event.get("endpoint"),
        "gen_ai.operation.name": _ENDPOINT_OPERATIONS.get(event.get("endpoint") or ""),
        "gen_ai.request.model": event.get("model"),
        "gen_ai.response.model": None if decision else event.get("served_model"),
        "triage.backend": event.get("backend"),
        "triage.replica": event.get("replica"),
        "triage.stream": event.get("stream"),
        "triage.key.name": event.get("key"),
        "gen_ai.usage.input_tokens": usage_in if isinstance(usage_in, int) else None,
        "gen_ai.usage.output_tokens": usage_out if isinstance(usage_out, int) else None,
        "triage.cost": event.get("cost"),
        "triage.attempts": len(event.get("attempts") or ()),
        "triage.route.model": route.get("model"),
        "triage.route.reason": route.get("reason"),
        "triage.route.confidence": route.get("confidence"),
        "triage.decision.tier": decision.get("tier"),
        "triage.decision.confidence": decision.get("confidence"),
        "triage.error.type": error.get("type"),
        "triage.error.code": error.get("code"),
    }
    span.set_attributes({k: v for k, v in values.items() if isinstance(v, str | bool | int | float)})


def cascade(gen: Generator[Ask, TierAnswer, Decision], q: Question) -> Generator[Ask, TierAnswer, Decision]:
    """``policies.cascade.steps``'s generator, traced in a traced request (else ``gen`` itself): a
    ``triage.cascade`` span, and a span per tier asked, current while the tier answers and ended
    with what the cascade made of its answer (confidence, threshold, outcome)."""
    scope = _SCOPE.get()
    return gen if scope is None else _traced_cascade(gen, q, scope)


def _traced_cascade(
    gen: Generator[Ask, TierAnswer, Decision], q: Question, scope: tuple[Tracer, Context]
) -> Generator[Ask, TierAnswer, Decision]:
    tracer, parent = scope
    attributes: dict[str, Any] = {"triage.question.type": q.type, "triage.question.options": len(q.options)}
    if q.task is not None:
        attributes["triage.question.task"] = q.task
    whole = tracer.start_span("triage.cascade", parent, attributes=attributes)
    outer = trace.set_span_in_context(whole, parent)
    asked: list[tuple[Span, int, TierAnswer | None]] = []  # a tier's span, when it answered, what it said
    steps: Sequence[Step] = ()
    current = scope
    try:
        ask = next(gen)
        while True:
            span = tracer.start_span(
                f"triage.tier {ask.tier}",
                outer,
                attributes={"triage.tier.name": ask.tier, "triage.tier.kind": ask.kind},
            )
            asked.append((span, 0, None))
            # generators run in their caller's context: what is set here is the caller's while it awaits the tier
            current = (tracer, trace.set_span_in_context(span, outer))
            _SCOPE.set(current)
            reply = yield ask
            asked[-1] = (span, time.time_ns(), reply)
            try:
                ask = gen.send(reply)
            except StopIteration as stop:
                decision: Decision = stop.value
                steps = decision.trace
                whole.set_attributes(
                    {
                        "triage.decision.tier": decision.tier,
                        "triage.decision.confidence": decision.confidence,
                        "triage.decision.assumed": decision.assumed,
                        "triage.decision.exhausted": any(s.outcome == "exhausted" for s in steps),
                    }
                )
                return decision
            except CascadeExhausted as exc:
                steps = exc.trace
                whole.set_attribute("error.type", exc.code or exc.type)
                whole.set_status(StatusCode.ERROR, exc.message)
                raise
    finally:
        if _SCOPE.get() is current:  # not when the generator is collected in another context
            _SCOPE.set(scope)
        for i, (span, ended, said) in enumerate(asked):
            _end_tier(span, steps[i] if i < len(steps) else None, said, ended or None)
        whole.set_attribute("triage.cascade.tiers_asked", len(asked))
        whole.end()


def _end_tier(span: Span, step: Step | None, reply: TierAnswer | None, ended: int | None) -> None:
    if step is not None:
        values: dict[str, Any] = {
            "triage.tier.outcome": step.outcome,
            "triage.tier.escalated": step.outcome != "accepted",
            "triage.tier.confidence": step.confidence,
            "triage.tier.threshold": step.threshold,
            "triage.tier.raw_confidence": step.raw_confidence,
            "triage.tier.model": step.model,
            "triage.tier.assumed": step.assumed,
            "triage.tier.error": step.error,
        }
        span.set_attributes({k: v for k, v in values.items() if v is not None})
        if step.outcome == "failed":
            span.set_status(StatusCode.ERROR, step.error)
    if reply is not None and reply.usage:
        span.set_attributes(_usage(reply.usage))
    span.end(end_time=ended)


def upstream(
    send: Callable[[Call], Awaitable[T]], call: Call, backend: str, model: str, chain: Sequence[str]
) -> Awaitable[T]:
    """``send(call)`` (a backend's ``complete`` or ``open_stream``), traced in a traced request: a
    client span for this model of the chain, the W3C trace context sent upstream, and a
    ``triage.attempt`` span per replica try the backend records."""
    scope = _SCOPE.get()
    return send(call) if scope is None else _traced_upstream(send, call, backend, model, chain, scope)


async def _traced_upstream(
    send: Callable[[Call], Awaitable[T]],
    call: Call,
    backend: str,
    model: str,
    chain: Sequence[str],
    scope: tuple[Tracer, Context],
) -> T:
    tracer, parent = scope
    operation, engine_model = _OPERATIONS[call.kind], str(call.body.get("model"))
    position = chain.index(model) if model in chain else 0
    span = tracer.start_span(
        f"{operation} {engine_model}",
        parent,
        SpanKind.CLIENT,
        attributes={
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": engine_model,
            "triage.model": model,
            "triage.backend": backend,
            "triage.chain.position": position,
            "triage.fallback": position > 0,
            "triage.stream": call.stream,
        },
    )
    here = trace.set_span_in_context(span, parent)
    tokens = otel_context.attach(here), TRACE_HEADERS.set(_context_headers(here))
    traced = replace(call, attempts=_Attempts(call.attempts, tracer, here))
    try:
        result = await send(traced)
    except TriageError as exc:
        span.set_attribute("error.type", exc.code or exc.type)
        if (upstream_status := getattr(exc, "upstream_status", None)) is not None:
            span.set_attribute("http.response.status_code", upstream_status)
        span.set_status(StatusCode.ERROR, exc.message)
        raise
    except BaseException as exc:
        span.set_attribute("error.type", type(exc).__qualname__)
        span.set_status(StatusCode.ERROR)
        raise
    else:
        _answered(span, result)
    finally:
        TRACE_HEADERS.reset(tokens[1])
        otel_context.detach(tokens[0])
        span.set_attribute("triage.attempts", len(traced.attempts))
        span.end()
    return result


def _answered(span: Span, result: Any) -> None:
    """What a completion (or an opened stream) says about who answered."""
    if isinstance(replica := getattr(result, "replica", None), str):
        span.set_attribute("triage.replica", replica)
    body = getattr(result, "body", None)
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        span.set_attribute("gen_ai.response.model", body["model"])
    if isinstance(usage := body.get("usage"), dict):
        span.set_attributes(_usage(usage))


def _usage(usage: Mapping[str, Any]) -> dict[str, int]:
    """An OpenAI ``usage`` as GenAI's token attributes."""
    names = {"prompt_tokens": "gen_ai.usage.input_tokens", "completion_tokens": "gen_ai.usage.output_tokens"}
    return {name: usage[key] for key, name in names.items() if isinstance(usage.get(key), int)}


class _Attempts(list[Attempt]):
    """``call.attempts`` as the backend sees it: each try it records goes on to the request's list,
    and becomes a ``triage.attempt`` span that ends now and lasted the try's latency."""

    def __init__(self, into: list[Attempt], tracer: Tracer, parent: Context) -> None:
        super().__init__()
        self._into, self._tracer, self._parent = into, tracer, parent

    def append(self, attempt: Attempt) -> None:
        super().append(attempt)
        self._into.append(attempt)
        end = time.time_ns()
        span = self._tracer.start_span(
            "triage.attempt",
            self._parent,
            start_time=end - int(attempt.latency_s * 1e9),
            attributes={
                "triage.backend": attempt.backend,
                "triage.replica": attempt.replica,
                "triage.attempt.outcome": attempt.outcome,
                "triage.attempt.number": len(self),
                "triage.retry": len(self) > 1,
            },
        )
        if attempt.outcome != "ok":
            span.set_attribute("error.type", attempt.outcome)
            span.set_status(StatusCode.ERROR)
        span.end(end_time=end)
