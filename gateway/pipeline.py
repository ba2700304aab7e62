"""The one path a generating request takes, whatever surface it came in by (chat and text
completions, the Responses API and Anthropic's Messages translated to chat, a batch's lines):
check the body, resolve the requested name once (a cascade model's typed question is decided by the
cascade, its other requests go to its open route; a semantic or routed model is routed by the
encoder; an alias or a model goes down its chain), dispatch, and say what answered."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from backends.base import Attempt, Kind
from gateway import decide, typed
from gateway.dispatch import Served, decide_route, dispatch
from gateway.runtime import Runtime
from gateway.schemas import ChatRequest, CompletionRequest, check
from policies.cascade import Decision
from policies.schema import CascadeModel

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
    request = check(ChatRequest if kind == "chat" else CompletionRequest, body)
    body["stream"] = request.stream  # the validated value, not a truthy string
    vm = rt.policy.virtual_models.get(body["model"])
    if isinstance(vm, CascadeModel):
        ask = typed.typed_ask(body, rt.policy.cascade) if kind == "chat" and rt.policy.cascade else None
        if ask is not None:
            d = await decide.decide(rt, ask.question, None, request_id, attempts)
            reply = typed.completion(ask, d, body["model"], request_id, decide.body(d, request_id))
            return Outcome(typed=reply, decision=d, stream=request.stream)
        body["model"] = vm.open  # untyped: served by the cascade model's open route
    route = await decide_route(rt, kind, body)
    work = dispatch(rt, kind, body, request_id, attempts, route, affinity)
    served = await (wait(work) if wait is not None else work)
    if served.completion is not None:
        served.completion.body["model"] = served.model
    return Outcome(served=served, stream=request.stream)
