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

import structlog

from backends.base import Body, Kind
from gateway.service import decisions, embeddings, messages, pipeline, typed
from gateway.service.bodies import ChatRequest, CompletionRequest, check
from gateway.service.cache import response as response_cache
from gateway.service.cache import semantic as semantic_cache
from gateway.service.context import Context
from gateway.service.decisions import Overrides
from gateway.service.dispatch import Served
from gateway.service.keys import quotas
from gateway.service.quality import shadow
from gateway.service.runtime import Runtime
from policies.cascade import Decision, Question
from policies.fit import Shape, shape_of
from policies.plans import ChainPlan, EncoderPlan, TypedPlan, resolve
from policies.schema import RoutedModel

log = structlog.get_logger("triage.cache")


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
        if kind == "chat":
            body["messages"] = messages.for_engines(body["messages"])
        requested = body["model"]
        plan = resolve(self.rt.policy, body["model"])
        if isinstance(plan, TypedPlan):
            ask = typed.typed_ask(body, plan.cascade) if kind == "chat" and plan.cascade is not None else None
            if ask is not None:
                d = await self.decide(ask.question, None, ctx)
                reply = typed.completion(ask, d, body["model"], ctx.request_id, decisions.body(d, ctx.request_id))
                return Outcome(typed=reply, decision=d, stream=stream)
            body["model"], plan = plan.open.name, plan.open  # untyped: served by the cascade model's open route
        assert not isinstance(plan, TypedPlan), "validated: a cascade model's open route is no cascade model"
        cache = response_cache.begin(self.rt, kind, body, ctx, requested)
        shape = shape_of(kind, body)  # what it needs of a model: its context, tools, images
        if cache is not None and (hit := await cache.find()) is not None:
            if cache.similar and cache.semantic is not None and cache.semantic.audit_due():
                cache.semantic.later(self._audit(cache, plan, kind, body, hit, ctx, shape))
            replay = response_cache.replayed(cache, hit, ctx.request_id, stream, body)
            return Outcome(served=replay, stream=stream, cache=cache.note)
        routed = self.rt.watch is not None and isinstance(plan, EncoderPlan) and isinstance(plan.model, RoutedModel)
        asked = dict(body) if routed else body  # as the caller sent it (a shadow call asks the same)
        served = await ctx.waited(pipeline.serve_plan(self.rt, plan, kind, body, ctx, shape))
        if routed:
            assert self.rt.watch is not None and isinstance(plan, EncoderPlan)
            shadow.routed(self.rt, self.rt.watch, plan, kind, asked, served, ctx, shape)
        if served.completion is not None:
            served.completion.body["model"] = served.model
        if cache is not None and cache.write:
            if served.completion is None:
                served = cache.kept_after(served)
            else:  # kept off the request's path (a Redis write is a round trip)
                self.rt.later(cache.keep(served.model, served.completion.body))
        return Outcome(served=served, stream=stream, cache=cache.note if cache is not None else None)

    async def decide(self, q: Question, overrides: Overrides | None, ctx: Context) -> Decision:
        """The cascade's decision on one typed question."""
        d = await ctx.waited(decisions.make(self.rt, q, overrides, ctx, self.serve_tier))
        if self.rt.watch is not None:
            shadow.decided(self.rt, self.rt.watch, q, d, ctx, self.serve_tier)
        return d

    async def decide_many(
        self, items: Sequence[tuple[Question, Overrides | None]], ctx: Context
    ) -> list[Decision | Exception]:
        """Several questions, answers in order (an item that fails is its error)."""
        out = await ctx.waited(decisions.make_many(self.rt, list(items), ctx, self.serve_tier))
        if self.rt.watch is not None:
            for i, d in enumerate(out):
                if isinstance(d, Decision):
                    shadow.decided(self.rt, self.rt.watch, items[i][0], d, ctx.item(i), self.serve_tier)
        return out

    async def embed(self, body: dict[str, Any], ctx: Context) -> Outcome:
        """Embeddings of a request's body: the encoder's, or a policy model's engine's."""
        return Outcome(served=await ctx.waited(embeddings.embed(self.rt, body, ctx)))

    async def _audit(
        self,
        cache: response_cache.Lookup,
        plan: ChainPlan | EncoderPlan,
        kind: Kind,
        body: dict[str, Any],
        hit: Served,
        ctx: Context,
        shape: Shape,
    ) -> None:
        """A semantic hit's answer checked against a fresh one, off the request's path, at the
        operator's cost (no key is charged): the semantic cache counts the wrong hits."""
        assert cache.semantic is not None and hit.completion is not None
        audit = Context(f"{ctx.request_id}-audit", surface="cache_audit")
        fresh = await pipeline.serve_plan(self.rt, plan, kind, {**body, "stream": False}, audit, shape)
        assert fresh.completion is not None
        said, now = response_cache.answer_text(hit.completion.body), response_cache.answer_text(fresh.completion.body)
        right = said == now or semantic_cache.agree(await cache.semantic.embed(said), await cache.semantic.embed(now))
        cost = quotas.price(self.rt, fresh.model, fresh.completion.body.get("usage"))
        log.info("semantic_cache_audited", request_id=ctx.request_id, right=right, model=fresh.model, cost=cost)
        cache.semantic.audited_hit(right)

    async def serve_tier(self, body: Body, ctx: Context) -> Served:
        """A model tier's question, served by its model's plan (the port the cascade's tiers get)."""
        return await pipeline.serve_chat(self.rt, body, ctx)
