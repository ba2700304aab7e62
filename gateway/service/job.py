"""One generating request, built once (issue 52): what is asked, checked, with the plan its model
resolved to. Every step after the door reads the job; none writes into the caller's body. The
body an engine gets is made from the job at each link of the chain
(:func:`gateway.service.dispatch.dispatch`: the link's upstream name, a route's reasoning switch).

Also the service's result type (:class:`Outcome`) and the shape of the generate path the response
cache and the quality watch wrap (:class:`Serve`: a layer each, composed once at assembly).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from backends.base import Body, ChunkStream, Completion, Kind
from gateway.service import messages, typed
from gateway.service.bodies import ChatRequest, CompletionRequest, check
from policies.cascade import Decision
from policies.fit import Shape, shape_of
from policies.plans import ChainPlan, EncoderPlan, SplitPlan, TypedPlan, resolve
from policies.schema import Policy
from policies.semantic import Route

if TYPE_CHECKING:
    from gateway.service.context import Context
    from gateway.service.runtime import Runtime


@dataclass
class Served:
    """What a link of the chain answered: its model, backend and replica, a whole completion or
    a stream, the encoder's route when it chose the model, and the models skipped on the way."""

    model: str
    backend: str
    replica: str
    completion: Completion | None = None
    stream: ChunkStream | None = None
    route: Route | None = None
    reasoning_switch: str | None = None
    skipped: tuple[tuple[str, str], ...] = ()  # models down the chain that could not take it, and why
    split: str | None = None  # a split virtual model's choice: "name=target"
    fallbacks: tuple[tuple[str, str], ...] = ()  # models that failed before this one answered, and why


@dataclass(frozen=True, slots=True)
class Job:
    """A request as the service serves it. ``body``: the checked body, read-only (chat messages in
    the engines' form, ``stream`` the validated flag); ``requested``: the model the caller named;
    ``plan``: what that name resolved to (a cascade model's open route when the request is not its
    typed question); ``typed``: the typed question a cascade model answers, if it is one;
    ``shape``: what it needs of a model (its context, tools, images)."""

    kind: Kind
    body: Mapping[str, Any]
    requested: str
    plan: ChainPlan | EncoderPlan | SplitPlan | None
    stream: bool = False
    shape: Shape | None = None
    typed: typed.TypedAsk | None = None

    def upstream(self, model: str) -> Body:
        """The body a link of the chain sends: a fresh dict, the link's model name in it."""
        return {**self.body, "model": model}

    def whole(self) -> Job:
        """The same job asked as one answer (an audit, a shadow check)."""
        return replace(self, body=MappingProxyType({**self.body, "stream": False}), stream=False)


def make(policy: Policy, kind: Kind, body: Mapping[str, Any]) -> Job:
    """A chat or text completion body, checked (400 naming the field) and its model resolved once."""
    request = check(ChatRequest if kind == "chat" else CompletionRequest, body)
    checked: Body = {**body, "stream": request.stream}  # the validated value, not a truthy string
    if kind == "chat":
        checked["messages"] = messages.for_engines(body["messages"])
    requested = str(body["model"])
    plan = resolve(policy, requested)
    ask = None
    if isinstance(plan, TypedPlan):
        ask = typed.typed_ask(checked, plan.cascade) if kind == "chat" and plan.cascade is not None else None
        plan = plan.open  # untyped: served by the cascade model's open route
    assert not isinstance(plan, TypedPlan), "validated: a cascade model's open route is no cascade model"
    return Job(kind, MappingProxyType(checked), requested, plan, request.stream, shape_of(kind, checked), ask)


def internal(
    kind: Kind, body: Mapping[str, Any], plan: ChainPlan | EncoderPlan | SplitPlan | None, shape: Shape | None
) -> Job:
    """A job the gateway asks itself (a cascade tier's question, a shadow check, an embedding):
    its body made by triage, not checked again."""
    return Job(kind, MappingProxyType(dict(body)), str(body.get("model")), plan, bool(body.get("stream")), shape)


@dataclass
class Note:
    """What the cache did for one request (its headers, its log event, what a hit is charged)."""

    result: str  # hit | miss | bypass
    why: str | None = None  # a bypass's reason
    match: str | None = None  # a hit's: exact, or "semantic 0.9412"
    price: float = 0.0  # a hit: what its answer cost when it was made (0 when unknown)
    charged: float = 0.0  # a hit: what this request is charged for it
    lookup_ms: float | None = None  # how long the lookup took (the semantic one's encoder pass included)
    embed_ms: float | None = None  # of which the encoder's pass (a semantic lookup)

    def headers(self) -> dict[str, str]:
        out = {"x-triage-cache": self.result}
        if self.why is not None:
            out["x-triage-cache-bypass"] = self.why
        if self.match is not None:
            out["x-triage-cache-match"] = self.match
        return out

    def event(self) -> dict[str, Any]:
        out: dict[str, Any] = {"result": self.result}
        if self.why is not None:
            out["why"] = self.why
        if self.result == "hit":
            out.update(match=self.match, saved=round(self.price - self.charged, 8))
        if self.lookup_ms is not None:
            out["lookup_ms"] = self.lookup_ms
        if self.embed_ms is not None:
            out["embed_ms"] = self.embed_ms
        return out


@dataclass
class Outcome:
    """What answered one request: an engine (a completion or a stream), the encoder (embeddings),
    or the cascade (a typed decision's chat completion, and the decision)."""

    served: Served | None = None
    typed: Body | None = None
    decision: Decision | None = None
    stream: bool = False
    cache: Note | None = None  # what the response cache did (None: the policy keeps no answers)

    @property
    def whole(self) -> Body | None:
        """The answer's body when it is whole (not a stream)."""
        if self.typed is not None:
            return self.typed
        return self.served.completion.body if self.served is not None and self.served.completion is not None else None


class Serve(Protocol):
    """The generate path for an untyped job: the engines' (``Service``'s core), or a layer around it."""

    async def __call__(self, rt: Runtime, job: Job, ctx: Context) -> Outcome: ...
