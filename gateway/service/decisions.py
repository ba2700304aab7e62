"""Typed decisions at the edge: ``/v1/decide`` bodies, the cascade driven against live tiers,
and the answer's shape."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.obs import tracing
from gateway.service import recall, tier_answers
from gateway.service.context import Context
from gateway.service.runtime import Runtime
from gateway.service.tier_answers import ServeChat
from gateway.state.stores import StoreDown
from policies import cascade, cascade_routing
from policies.cascade import Decision, Gate, Judge, Question, Step
from policies.cascade_routing import Routing
from policies.errors import Forbidden, InvalidRequest, NotFound, TriageError
from policies.fit import nothing_fits
from policies.schema import ApiKey
from policies.tiers import Cascade, ModelTier, QuestionType

log = structlog.get_logger("triage.decide")
CACHE_FORMAT = 1  # the kept decision's shape: a change of Decision or Step bumps it (old entries then miss)


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Scale(_Closed):
    min: int
    max: int

    @model_validator(mode="after")
    def _order(self) -> Scale:
        if self.max <= self.min:
            raise ValueError("scale.max must be greater than scale.min")
        return self


class Overrides(_Closed):
    thresholds: dict[str, dict[QuestionType, Annotated[float, Field(ge=0, le=1)]]] | None = Field(
        None, description="tier name -> question type -> threshold, over the policy's"
    )


class DecideRequest(_Closed):
    question: str = Field(min_length=1)
    context: str | None = None
    type: QuestionType
    options: list[str] | None = None
    scale: Scale | None = None
    task: str | None = None
    policy_overrides: Overrides | None = None


@dataclass(frozen=True)
class Plan:
    """A decision's plan, made once per request (:func:`plan`) and read by every step after it:
    the cascade the policy serves, the model tiers the caller's key may not ask (tier -> why), and
    the tasks the policy's classifier knows."""

    spec: Cascade
    shut: Mapping[str, str]
    tasks: frozenset[str]


def plan(rt: Runtime, key: ApiKey | None) -> Plan:
    """The plan of a decision ``key`` asks for: 404 when the policy has no cascade (every door to a
    decision: the routes, a batch's line, a typed chat request), 403 when the key may ask no tier."""
    spec = rt.policy.cascade
    if spec is None:
        raise NotFound("this policy has no cascade section: /v1/decide is not served")
    tasks = frozenset(rt.policy.classifier.tasks) if rt.policy.classifier is not None else frozenset()
    return Plan(spec, barred(rt, spec, key), tasks)


Parsed = tuple[Question, Overrides | None]


def parse(body: Any, plan: Plan) -> Parsed:
    """One ``/v1/decide`` body read against the plan (400 naming the field when bad)."""
    try:
        req = DecideRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}", param=param) from None
    return question(req, plan.spec, set(plan.tasks)), checked(plan.spec, req.policy_overrides)


def parse_many(raw: Any, plan: Plan) -> list[Parsed | InvalidRequest]:
    """A ``/v1/decide/batch`` body (a list of questions, or ``{"questions": [...]}``): each item
    read, a bad one kept as its own error (400 for the whole when it is no list, or too long)."""
    items = raw.get("questions") if isinstance(raw, dict) else raw
    if not isinstance(items, list) or not items:
        raise InvalidRequest('the body must be a non-empty list of questions (or {"questions": [...]})')
    if len(items) > plan.spec.max_batch:
        raise InvalidRequest(f"at most {plan.spec.max_batch} questions per batch, not {len(items)}")
    out: list[Parsed | InvalidRequest] = []
    for item in items:
        try:
            out.append(parse(item, plan))
        except InvalidRequest as exc:
            out.append(exc)
    return out


def question(req: DecideRequest, spec: Cascade, tasks: set[str]) -> Question:
    if req.task is not None and req.task not in tasks:
        raise InvalidRequest(
            f"unknown task '{req.task}' (the policy names: {', '.join(sorted(tasks)) or 'none'})", param="task"
        )
    scale = None
    if req.type == "choice":
        if not req.options or not 2 <= len(req.options) <= spec.max_options:
            raise InvalidRequest(f"a choice question needs 2 to {spec.max_options} options", param="options")
        options = tuple(req.options)
    elif req.type == "yes_no":
        if req.options is not None and len(req.options) != 2:
            raise InvalidRequest("a yes_no question has two options (yes first), or none", param="options")
        options = tuple(req.options) if req.options else cascade.YES_NO
    else:
        if req.options is not None:
            raise InvalidRequest("a score question takes a scale, not options", param="options")
        if req.scale is not None:
            values = req.scale.max - req.scale.min + 1
            if values > spec.max_scale:
                raise InvalidRequest(f"a scale may have at most {spec.max_scale} values, not {values}", param="scale")
            scale = (req.scale.min, req.scale.max)
        options = tuple(str(v) for v in range(scale[0], scale[1] + 1)) if scale else ()
    return Question(req.type, req.question, options, req.context, req.task, scale)


def _by_type(*parts: Mapping[QuestionType, float]) -> dict[str, float]:
    """Numbers per question type as a gate takes them (str keys), a later part's winning."""
    return {k: v for part in parts for k, v in part.items()}


def checked(spec: Cascade, overrides: Overrides | None) -> Overrides | None:
    """``overrides`` when every tier it names is the cascade's; else 400 naming the field."""
    names = {t.name for t in spec.tiers}
    for name in (overrides.thresholds if overrides is not None else None) or {}:
        if name not in names:
            raise InvalidRequest(
                f"policy_overrides.thresholds: no tier named '{name}' (tiers: {', '.join(t.name for t in spec.tiers)})",
                param="policy_overrides.thresholds",
            )
    return overrides


def gates(spec: Cascade, overrides: Overrides | None, judges: Mapping[str, Judge] | None = None) -> list[Gate]:
    checked(spec, overrides)
    extra = (overrides.thresholds if overrides is not None else None) or {}
    return [
        Gate(
            t.name,
            t.type,
            _by_type(t.thresholds, extra.get(t.name, {})),
            t.task_thresholds,
            _by_type(t.temperature),
            (judges or {}).get(t.name),
            t.task_temperature,
            t.escalation_margin,
            accuracy=_by_type(t.accuracy),
            agreement={k: v.rule() for k, v in t.agreement.items()},
            per_call=t.prices.per_call,
            per_1k_tokens=t.prices.per_1k_tokens,
        )
        for t in spec.tiers
    ]


def routing(spec: Cascade) -> Routing | None:
    r = spec.routing
    return None if r is None else Routing(r.knob, {k: v.rule() for k, v in r.agreement.items()})


async def make(
    rt: Runtime, p: Plan, q: Question, overrides: Overrides | None, ctx: Context, serve_chat: ServeChat
) -> Decision:
    """The cascade's decision; with ``cascade.cache_ttl_s``, from the decision cache when the same
    question was decided under the same policy version (a hit asks no tier and costs nothing).
    A model tier whose model the caller's key may not reach is skipped (the plan's ``shut``); a
    model tier's question is served by ``serve_chat``."""
    spec, shut = p.spec, p.shut
    if spec.cache_ttl_s is None or rt.budget is not None:  # a budget's thresholds move: not a pure function
        return await _make(rt, p, q, overrides, ctx, serve_chat)
    ckey = cache_key(rt.version, q, overrides, sorted(shut))
    try:
        hit = await rt.store.cache_get(ckey)
    except StoreDown as exc:  # the cache only saves work: decide without it
        log.warning("decision_cache_unavailable", error=exc.message)
        return await _make(rt, p, q, overrides, ctx, serve_chat)
    if hit is not None and (kept := unpack(hit)) is not None:
        return dataclasses.replace(kept, cached=True)
    decision = dataclasses.replace(await _make(rt, p, q, overrides, ctx, serve_chat), cached=False)
    try:
        await rt.store.cache_put(ckey, pack(decision), spec.cache_ttl_s)
    except StoreDown as exc:
        log.warning("decision_cache_unavailable", error=exc.message)
    return decision


def barred(rt: Runtime, spec: Cascade, key: ApiKey | None) -> dict[str, str]:
    """The model tiers ``key`` may not ask (tier name -> why); Forbidden (403) when it may ask none."""
    allowed = rt.reach(key)
    if allowed is None or key is None:
        return {}
    shut = {
        t.name: f"the key '{key.name}' may not use the model '{t.model}'"
        for t in spec.tiers
        if isinstance(t, ModelTier) and t.model not in allowed
    }
    if len(shut) == len(spec.tiers):
        listed = ", ".join(key.models or [])
        raise Forbidden(f"the key '{key.name}' may use no tier of the cascade (its models: {listed})")
    return shut


def cache_key(version: str, q: Question, overrides: Overrides | None, shut: list[str] | None = None) -> str:
    """What a decision is a pure function of: the policy's version (its text, tiers and trained
    files) and the question; a request's own thresholds, and the tiers its key may not ask, too."""
    parts: list[Any] = [CACHE_FORMAT, version, q.type, q.question, q.options, q.context, q.task, q.scale]
    if overrides is not None:
        parts.append(overrides.model_dump(mode="json"))
    if shut:
        parts.append(shut)
    return "decide:" + hashlib.sha256(orjson.dumps(parts)).hexdigest()


def pack(d: Decision) -> bytes:
    return orjson.dumps(dataclasses.asdict(d))


def unpack(raw: bytes) -> Decision | None:
    """A kept decision; None when it does not read as one (another version of triage wrote it)."""
    try:
        doc = orjson.loads(raw)
        doc["trace"] = tuple(Step(**s) for s in doc["trace"])
        return Decision(**doc)
    except (orjson.JSONDecodeError, TypeError, KeyError, AttributeError):
        log.warning("decision_cache_unreadable")
        return None


async def _make(
    rt: Runtime, p: Plan, q: Question, overrides: Overrides | None, ctx: Context, serve_chat: ServeChat
) -> Decision:
    spec, shut = p.spec, p.shut
    by_name = {t.name: t for t in spec.tiers}
    chosen = [dataclasses.replace(g, barred=shut.get(g.name)) for g in gates(spec, overrides, rt.judges)]
    if rt.budget is not None and overrides is None:  # a request's own thresholds are its own
        chosen = rt.budget.gates(chosen)
    budget = rt.budget if overrides is None and not shut else None  # a key's narrower cascade is not the policy's
    embedding = await tier_answers.question_embedding(rt, q, chosen, always=rt.recall is not None)
    examples = recall.recall(rt.recall, spec, q, embedding, rt.memory_feed)
    gen = tracing.cascade(cascade_routing.steps_for(q, chosen, spec.on_exhausted, embedding, routing(spec)), q)
    ask = next(gen)
    while True:
        tier = by_name[ask.tier]
        reply = await tier_answers.answer(rt, tier, recall.shown(tier, ask, examples), ctx, serve_chat, embedding)
        try:
            ask = gen.send(recall.said(tier, reply, examples))
        except StopIteration as stop:
            decision: Decision = stop.value
            if budget is not None and decision.trace:
                budget.observe(decision.trace[0])
            recall.remember(rt.recall, spec, q, embedding, decision, rt.memory_feed)
            return decision
        except cascade.CascadeExhausted as exc:
            if budget is not None and exc.trace:
                budget.observe(exc.trace[0])
            if exc.trace and all(step.outcome == "skipped" for step in exc.trace):
                # no tier could take the question (too long for each, a type none answers): the
                # request's fault, a 400 like a chat request that fits no model, not the cascade's 502
                refused = [(step.tier, step.error or "skipped") for step in exc.trace]
                raise nothing_fits("in the cascade", refused, "question") from None
            raise


async def make_many(
    rt: Runtime,
    p: Plan,
    items: list[tuple[Question, Overrides | None]],
    ctx: Context,
    serve_chat: ServeChat,
    concurrency: int = 8,
) -> list[Decision | Exception]:
    """Several questions, answers in order (an item that fails is its error). Questions sharing a
    context go back to back, so the local scorer finds the passage in its cache; up to
    ``concurrency`` run at once (the encoder batches them)."""
    order = sorted(range(len(items)), key=lambda i: (items[i][0].context or "", items[i][0].question))
    results: dict[int, Decision | Exception] = {}
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with limit:
            try:
                results[i] = await make(rt, p, items[i][0], items[i][1], ctx.item(i), serve_chat)
            except TriageError as exc:  # the item's own error entry (the cascade exhausted, an engine down)
                results[i] = exc

    await asyncio.gather(*(one(i) for i in order))
    return [results[i] for i in range(len(items))]


def body(d: Decision, request_id: str) -> dict[str, Any]:
    return {
        "id": f"decide-{request_id}",
        "object": "decision",
        "answer": d.answer,
        "probabilities": {k: round(v, 6) for k, v in d.probabilities.items()},
        "confidence": round(d.confidence, 6),
        # false: the answering tier gave no probabilities; these are its policy's assumed confidence
        "probabilities_measured": not d.assumed,
        "tier": d.tier,
        "trace": [s.as_dict() for s in d.trace],
        "usage": dict(d.usage) if d.usage else None,
        **({"cache": "hit" if d.cached else "miss"} if d.cached is not None else {}),
    }
