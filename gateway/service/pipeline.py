"""The one path a generating request takes, whatever surface it came in by (chat and text
completions, the Responses API and Anthropic's Messages translated to chat, a batch's lines):
check the body, resolve the requested name once into a plan (``policies.plans``: a cascade model's
typed question is decided by the cascade, its other requests go to its open route; a semantic or
routed model is routed by the encoder; an alias or a model goes down its chain), run the plan
(:func:`handle`), and say what answered."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from backends.base import Attempt, Body, Kind
from gateway.service import decide, typed
from gateway.service.dispatch import Served, dispatch
from gateway.service.runtime import Runtime
from gateway.service.schemas import ChatRequest, CompletionRequest, check
from policies.cascade import Decision
from policies.plans import ChainPlan, EncoderPlan, Plan, TypedPlan, resolve
from policies.schema import RoutedModel
from policies.semantic import Route

Wait = Callable[[Awaitable[Served]], Awaitable[Served]]  # how a dispatch is awaited (a client that leaves stops it)


@dataclass
class Outcome:
    """An engine's answer (a completion or a stream), or a typed decision's chat completion."""

    served: Served | None = None
    typed: dict[str, Any] | None = None
    decision: Decision | None = None
    stream: bool = False


async def run(
    rt: Runtime,
    kind: Kind,
    body: dict[str, Any],
    request_id: str,
    attempts: list[Attempt],
    affinity: str | None = None,
    wait: Wait | None = None,
) -> Outcome:
    """Check ``body``, resolve its model once, and :func:`handle` the plan."""
    request = check(ChatRequest if kind == "chat" else CompletionRequest, body)
    body["stream"] = request.stream  # the validated value, not a truthy string
    plan = resolve(rt.policy, body["model"])
    return await handle(rt, plan, kind, body, request_id, attempts, affinity, wait)


async def handle(
    rt: Runtime,
    plan: Plan,
    kind: Kind,
    body: dict[str, Any],
    request_id: str,
    attempts: list[Attempt],
    affinity: str | None = None,
    wait: Wait | None = None,
) -> Outcome:
    """Run a plan: a typed question to the cascade, anything else down the chain its route picks."""
    stream = bool(body.get("stream"))
    if isinstance(plan, TypedPlan):
        ask = typed.typed_ask(body, rt.policy.cascade) if kind == "chat" and rt.policy.cascade else None
        if ask is not None:
            d = await decide.decide(rt, ask.question, None, request_id, attempts)
            reply = typed.completion(ask, d, body["model"], request_id, decide.body(d, request_id))
            return Outcome(typed=reply, decision=d, stream=stream)
        body["model"], plan = plan.open.name, plan.open  # untyped: served by the cascade model's open route
    assert not isinstance(plan, TypedPlan), "validated: a cascade model's open route is no cascade model"
    work = serve(rt, plan, kind, body, request_id, attempts, affinity)
    served = await (wait(work) if wait is not None else work)
    if served.completion is not None:
        served.completion.body["model"] = served.model
    return Outcome(served=served, stream=stream)


async def serve(
    rt: Runtime,
    plan: ChainPlan | EncoderPlan,
    kind: Kind,
    body: Body,
    request_id: str,
    attempts: list[Attempt],
    affinity: str | None = None,
) -> Served:
    """An untyped plan dispatched: the encoder's pick (then that model's chain), or the plan's chain."""
    route = await _route(rt, plan, kind, body) if isinstance(plan, EncoderPlan) else None
    chain = resolve(rt.policy, route.model).chain if route is not None else plan.chain
    return await dispatch(rt, kind, body, request_id, attempts, chain, route, affinity)


async def _route(rt: Runtime, plan: EncoderPlan, kind: Kind, body: Body) -> Route:
    """The encoder's route for a semantic or routed virtual model."""
    assert rt.encoding is not None, "a semantic or routed model without a classifier fails validation"
    vm = plan.model
    if isinstance(vm, RoutedModel):
        return await rt.encoding.route_quality(rt.policy, vm, rt.quality[plan.name], kind, body)
    router = vm.reasoning.router  # `reasoning: {mode: router}`: that routed model switches reasoning
    if router is None:
        return await rt.encoding.route(vm, kind, body)
    reasoning_router = rt.policy.virtual_models[router]
    assert isinstance(reasoning_router, RoutedModel), "validated: mode router names a routed model"
    return await rt.encoding.route(vm, kind, body, (rt.policy, reasoning_router, rt.quality[router]))
