"""The gateway's one front door, whatever surface a request came in by: three verbs on the
runtime a request pinned.

- :meth:`Service.generate`: a chat or text completion body (the Responses API and Anthropic's
  Messages translated to chat, a batch's lines): checked, its model resolved once into a plan
  (``policies.plans``); a cascade model's typed question is decided by the cascade, anything
  else served down the chain its route picks (``pipeline``);
- :meth:`Service.decide`: a typed question decided by the cascade (``decide``), its model tiers
  served through the service's own chat path, handed to them as a port;
- :meth:`Service.embed`: embeddings, the encoder's or an engine's (``embeddings``).

Each takes the request's :class:`~gateway.service.context.Context` and gives one
:class:`Outcome` (or a decision), which the edge records once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.base import Body, Kind
from gateway.service import decisions, embeddings, pipeline, response_cache, typed
from gateway.service.bodies import ChatRequest, CompletionRequest, check
from gateway.service.context import Context
from gateway.service.decisions import Overrides
from gateway.service.dispatch import Served
from gateway.service.runtime import Runtime
from policies.cascade import Decision, Question
from policies.fit import shape_of
from policies.plans import TypedPlan, resolve


@dataclass
class Outcome:
    """What answered one request: an engine (a completion or a stream), the encoder (embeddings),
    or the cascade (a typed decision's chat completion, and the decision)."""

    served: Served | None = None
    typed: Body | None = None
    decision: Decision | None = None
    stream: bool = False
    cache: response_cache.Note | None = None  # what the response cache did (None: the policy keeps no answers)

    @property
    def whole(self) -> Body | None:
        """The answer's body when it is whole (not a stream)."""
        if self.typed is not None:
            return self.typed
        return self.served.completion.body if self.served is not None and self.served.completion is not None else None


@dataclass(frozen=True, slots=True)
class Service:
    rt: Runtime

    async def generate(self, kind: Kind, body: dict[str, Any], ctx: Context) -> Outcome:
        """Check ``body``, resolve its model once, and serve the plan."""
        request = check(ChatRequest if kind == "chat" else CompletionRequest, body)
        body["stream"] = stream = request.stream  # the validated value, not a truthy string
        plan = resolve(self.rt.policy, body["model"])
        if isinstance(plan, TypedPlan):
            ask = typed.typed_ask(body, plan.cascade) if kind == "chat" and plan.cascade is not None else None
            if ask is not None:
                d = await self.decide(ask.question, None, ctx)
                reply = typed.completion(ask, d, body["model"], ctx.request_id, decisions.body(d, ctx.request_id))
                return Outcome(typed=reply, decision=d, stream=stream)
            body["model"], plan = plan.open.name, plan.open  # untyped: served by the cascade model's open route
        assert not isinstance(plan, TypedPlan), "validated: a cascade model's open route is no cascade model"
        cache = response_cache.begin(self.rt, kind, body, ctx)
        if cache is not None and (hit := await cache.find()) is not None:
            return Outcome(
                served=response_cache.replayed(cache, hit, ctx.request_id, stream, body),
                stream=stream,
                cache=cache.note,
            )
        shape = shape_of(kind, body)  # what it needs of a model: its context, tools, images
        served = await ctx.waited(pipeline.serve_plan(self.rt, plan, kind, body, ctx, shape))
        if served.completion is not None:
            served.completion.body["model"] = served.model
        if cache is not None and cache.write:
            if served.completion is not None:
                await cache.keep(served.model, served.completion.body)
            else:
                served = cache.kept_after(served)
        return Outcome(served=served, stream=stream, cache=cache.note if cache is not None else None)

    async def decide(self, q: Question, overrides: Overrides | None, ctx: Context) -> Decision:
        """The cascade's decision on one typed question."""
        return await ctx.waited(decisions.make(self.rt, q, overrides, ctx, self.serve_tier))

    async def decide_many(
        self, items: Sequence[tuple[Question, Overrides | None]], ctx: Context
    ) -> list[Decision | Exception]:
        """Several questions, answers in order (an item that fails is its error)."""
        return await ctx.waited(decisions.make_many(self.rt, list(items), ctx, self.serve_tier))

    async def embed(self, body: dict[str, Any], ctx: Context) -> Outcome:
        """Embeddings of a request's body: the encoder's, or a policy model's engine's."""
        return Outcome(served=await ctx.waited(embeddings.embed(self.rt, body, ctx)))

    async def serve_tier(self, body: Body, ctx: Context) -> Served:
        """A model tier's question, served by its model's plan (the port the cascade's tiers get)."""
        return await pipeline.serve_chat(self.rt, body, ctx)
