"""The API's routes: chat and text completions, the Responses API and Anthropic's Messages (one
handler, a surface adapter each), decisions, embeddings, feedback, stored responses, models, health,
metrics.

Every route that serves goes through :func:`gateway.http.doors.door` (the key, the body, the slot,
the key's limits, the bookkeeping, the error's shape) and asks :class:`gateway.service.service.Service`.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError
from starlette.routing import Route as HTTPRoute

from backends.base import Body
from gateway.http import openapi as openapi_doc
from gateway.http import surfaces
from gateway.http.doors import Call, door, error_response, gateway_state, json_response
from gateway.http.exchange import Exchange
from gateway.http.relay import Relay, events
from gateway.http.tool_arguments import Calls
from gateway.service import decisions, embeddings
from gateway.service.bodies import FeedbackRequest
from gateway.service.keys import quotas
from gateway.service.quality.watch import Watch
from gateway.service.runtime import Runtime
from gateway.service.service import Outcome
from policies import spend
from policies.cascade import CascadeExhausted, Decision
from policies.errors import InvalidRequest, ModelNotFound, NotFound, TriageError
from policies.plans import public_models
from policies.schema import ApiKey
from policies.semantic import Route

router = APIRouter()


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
        if q.probe is not None:  # the difficulty probe: "read 84.2ms", "not needed", "failed 2000.3ms"
            headers["x-triage-probe"] = q.probe.replace(" ", "-") + (
                "" if q.probe_ms is None else f" {q.probe_ms:.1f}ms"
            )
    if (rule := route.rule) is not None:  # "0 intents=transfer 0.9312": the rule, its head's answer (%-encoded)
        headers["x-triage-rule"] = f"{rule.index} {rule.head}={quote(rule.label)} {rule.confidence:.4f}"
    return headers


def decision_headers(ex: Exchange, d: Decision) -> dict[str, str]:
    headers = {"x-request-id": ex.request_id, "x-triage-tier": d.tier, "x-triage-confidence": f"{d.confidence:.4f}"}
    headers["x-triage-cost"] = f"{ex.cost or 0.0:.8f}"
    if d.cached is not None:
        headers["x-triage-cache"] = "hit" if d.cached else "miss"
    return headers


def answer_headers(ex: Exchange, out: Outcome) -> dict[str, str]:
    """What answered, as response headers (the outcome recorded in ``ex`` first)."""
    if out.decision is not None:
        return decision_headers(ex, out.decision)
    served = out.served
    assert served is not None
    headers = {"x-request-id": ex.request_id, "x-triage-model": served.model, "x-triage-backend": served.backend}
    if served.split is not None:  # a split virtual model's choice: "name=target"
        headers["x-triage-split"] = served.split
    if served.fallbacks:  # the models that failed first, and why: "big (context_window), ..."
        headers["x-triage-fallbacks"] = ", ".join(f"{m} ({why})" for m, why in served.fallbacks)
    if served.route is not None:
        headers.update(route_headers(served.route, served.reasoning_switch))
        if served.model != served.route.model:  # the route's model failed: a fallback answered
            headers["x-triage-fallback-from"] = served.route.model
    if served.completion is not None:
        headers["x-triage-cost"] = f"{ex.cost or 0.0:.8f}"
    if out.cache is not None:
        headers.update(out.cache.headers())
    skipped = [*(served.route.skipped if served.route is not None else ()), *served.skipped]
    if skipped:  # models that could not take it (context, tools, images), and why
        said = "; ".join(f"{model} ({why})" for model, why in skipped)
        headers["x-triage-skipped"] = said.encode("ascii", "replace").decode()
    return headers


async def _generate(call: Call, surface: surfaces.Surface) -> Response:
    """One handler for every generating surface: its chat body through the service, the answer
    in the surface's own shape (JSON, its events for a whole answer streamed, or its stream)."""
    ex, body = call.ex, surface.chat
    ex.prompt = body.get("messages") if surface.kind == "chat" else body.get("prompt")
    out = await ex.service.generate(surface.kind, body, call.context())
    ex.record(out)
    headers = answer_headers(ex, out)
    if (whole := out.whole) is not None:
        if out.served is not None:
            Calls().whole(whole).flag(ex.request_id, out.served.model, out.served.backend)
        return (
            events(await surface.whole_events(whole), headers)
            if out.stream
            else json_response(await surface.whole(whole), headers=headers)
        )
    assert out.served is not None and out.served.stream is not None
    return Relay(ex, out.served, headers, surface.relay(ex, out.served))


@door("chat")
async def chat_completions(call: Call) -> Response:
    return await _generate(call, surfaces.OpenAI("chat", call))


@door("completions")
async def completions(call: Call) -> Response:
    return await _generate(call, surfaces.OpenAI("completion", call))


@door("responses")
async def create_response(call: Call) -> Response:
    """``POST /v1/responses``: translated to chat, through the same service, translated back."""
    return await _generate(call, await surfaces.Responses.open(gateway_state(call.request), call))


@door("messages", anthropic=True)
async def create_message(call: Call) -> Response:
    """``POST /v1/messages`` (Anthropic): translated to chat, the same service, translated back;
    errors in Anthropic's shape; the key in ``x-api-key`` (or ``Authorization: Bearer``)."""
    return await _generate(call, surfaces.Messages(call))


@door("decide", served=decisions.plan)
async def decide_one(call: Call) -> Response:
    ex, plan = call.ex, call.served
    q, overrides = decisions.parse(call.body, plan)
    ex.prompt = q.question
    decision = await ex.service.decide(q, overrides, call.context(always=True), plan)
    ex.record(Outcome(decision=decision))
    return json_response(decisions.body(decision, ex.request_id), headers=decision_headers(ex, decision))


@door("decide_batch", any_json=True, served=decisions.plan)
async def decide_batch(call: Call) -> Response:
    """Every question answered, in order; a bad or unanswerable one gets its own error entry."""
    ex, plan = call.ex, call.served
    parsed = decisions.parse_many(call.body, plan)
    good = [(i, p) for i, p in enumerate(parsed) if not isinstance(p, InvalidRequest)]
    results = await ex.service.decide_many([p for _, p in good], call.context(always=True), plan)
    ex.decided(*(r for r in results if isinstance(r, Decision)))
    ex.charges += [
        c for r in results if isinstance(r, CascadeExhausted) for c in spend.trace_charges(ex.rt.policy.models, r.trace)
    ]
    ex.cost = sum(c for *_, c in ex.charges)
    answers: list[Body] = [p.body() if isinstance(p, InvalidRequest) else {} for p in parsed]
    for (i, _), result in zip(good, results, strict=True):
        rid = f"{ex.request_id}-{i}"
        answers[i] = result.body() if isinstance(result, TriageError) else decisions.body(result, rid)  # type: ignore[arg-type]
    return json_response(answers, headers={"x-request-id": ex.request_id, "x-triage-cost": f"{ex.cost or 0.0:.8f}"})


def _watched(rt: Runtime, key: ApiKey | None = None) -> Watch:
    if rt.watch is None:
        raise NotFound("this policy keeps no quality records: feedback needs a `quality` section")
    return rt.watch


@door("feedback", served=_watched)
async def feedback(call: Call) -> Response:
    """``POST /v1/feedback``: a verdict on one of the caller's own requests (its ``x-request-id``),
    kept beside its record and counted in the quality estimates; 404 for an unknown id or another
    key's request."""
    ex = call.ex
    try:
        req = FeedbackRequest.model_validate(call.body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}", param=param) from None
    owner = ex.key.sha256 if ex.key is not None else None  # a record is its key's secret's, as it was kept
    if not await _watched(ex.rt).feedback(req.request_id, owner, req.verdict, req.score):
        raise NotFound(f"no request '{req.request_id}' of this key is recorded", param="request_id")
    return json_response(
        {"object": "feedback", "request_id": req.request_id, "verdict": req.verdict, "score": req.score},
        headers={"x-request-id": ex.request_id},
    )


@door("embeddings")
async def embeddings_route(call: Call) -> Response:
    ex = call.ex
    ex.prompt = call.body.get("input")
    out = await ex.service.embed(call.body, call.context(always=True))
    ex.record(out)
    assert out.whole is not None
    return json_response(out.whole, headers=answer_headers(ex, out))


async def get_response(request: Request) -> Response:
    return await _stored(request, "get")


async def delete_response(request: Request) -> Response:
    return await _stored(request, "delete")


async def _stored(request: Request, action: str) -> Response:
    state = gateway_state(request)
    rt = state.holder.current
    response_id = request.path_params["response_id"]
    try:
        authorization = request.headers.get("authorization")
        await rt.authenticate(authorization)
        owner, operator = surfaces.owner(rt, authorization)
        store = rt.responses or state.responses
        if action == "delete":
            await store.delete(response_id, owner, operator)
            return json_response({"id": response_id, "object": "response.deleted", "deleted": True})
        return json_response((await store.get(response_id, owner, operator)).response)
    except TriageError as exc:
        return error_response(exc)


# The hot paths are plain Starlette routes: they read the raw body themselves, so FastAPI's
# dependency solving would only add time (measured by `python -m benchmarks overhead`).
HOT_ROUTES = [
    HTTPRoute("/v1/chat/completions", chat_completions, methods=["POST"]),
    HTTPRoute("/v1/completions", completions, methods=["POST"]),
    HTTPRoute("/v1/decide", decide_one, methods=["POST"]),
    HTTPRoute("/v1/decide/batch", decide_batch, methods=["POST"]),
    HTTPRoute("/v1/embeddings", embeddings_route, methods=["POST"]),
    HTTPRoute("/v1/feedback", feedback, methods=["POST"]),
    HTTPRoute("/v1/responses", create_response, methods=["POST"]),
    HTTPRoute("/v1/messages", create_message, methods=["POST"]),
    HTTPRoute("/v1/responses/{response_id}", get_response, methods=["GET"]),
    HTTPRoute("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
]


def _model_card(name: str) -> Body:
    return {"id": name, "object": "model", "created": 0, "owned_by": "triage"}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    rt = gateway_state(request).holder.current
    await rt.authenticate(request.headers.get("authorization"))
    names = [*public_models(rt.policy), *embeddings.served_models(rt)]
    return json_response({"object": "list", "data": [_model_card(m) for m in names]})


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str) -> Response:
    rt = gateway_state(request).holder.current
    await rt.authenticate(request.headers.get("authorization"))
    if model not in public_models(rt.policy) and model not in embeddings.served_models(rt):
        return error_response(ModelNotFound(f"The model '{model}' does not exist", param="model"))
    return json_response(_model_card(model))


@router.get("/health")
async def health() -> Response:
    return json_response({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    rt = gateway_state(request).holder.current
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
    if rt.watch is not None and (rt.watch.drift or rt.watch.store_problem):  # serving; the operator should look
        body["quality"] = {
            "drift": [f"{d.label}: {d.reason}" for d in rt.watch.drift],
            **({"store": rt.watch.store_problem} if rt.watch.store_problem else {}),
        }
    return json_response(body, 200 if ok else 503)


def _problem(backend: Any) -> str | None:
    problem = getattr(backend, "problem", None)
    return problem() if callable(problem) else None


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    rt = gateway_state(request).holder.current
    if not rt.policy.access.public_metrics:
        await rt.authenticate(request.headers.get("authorization"))  # a scraper without one: access.public_metrics
    return Response(gateway_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> Response:
    """The OpenAPI document, behind the key like the API it describes."""
    rt = gateway_state(request).holder.current
    await rt.authenticate(request.headers.get("authorization"))
    keys, public = rt.keys_required, rt.policy.access.public_metrics
    doc = openapi_doc.document_bytes(request.app.title, request.app.version, keys, public)
    return Response(doc, media_type="application/json")
