"""The gateway's one front door, whatever surface a request came in by: the verbs on the
runtime a request pinned.

- :meth:`Service.generate`: a chat or text completion body (the Responses API and Anthropic's
  Messages translated to chat, a batch's lines): checked, its model resolved once into a plan
  (``policies.plans``) into a job (``job``); a cascade model's typed question is decided by the
  cascade, anything else served through the layers composed at assembly, down the chain its
  route picks (``pipeline``);
- :meth:`Service.decide` (and ``decide_many``): a typed question decided by the cascade on the
  request's decision plan (``decisions``), its model tiers served through the service's own chat
  path, handed to them as a port;
- :meth:`Service.embed`: embeddings, the encoder's or an engine's (``embeddings``).

Each takes the request's :class:`~gateway.service.context.Context` and gives one
:class:`Outcome` (or a decision), which the edge records once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backends.base import Body, Kind
from gateway.service import decisions, embeddings, pipeline, typed
from gateway.service import job as jobs
from gateway.service.context import Context
from gateway.service.decisions import Overrides
from gateway.service.job import Job, Outcome, Served
from gateway.service.runtime import Runtime
from policies.cascade import Decision, Question


@dataclass(frozen=True, slots=True)
class Service:
    rt: Runtime

    async def generate(self, kind: Kind, body: Mapping[str, Any], ctx: Context) -> Outcome:
        """Check ``body`` and resolve its model once (a job: :func:`gateway.service.job.make`); a
        cascade model's typed question is decided, anything else served through the policy's
        layers (response cache, quality watch: composed at assembly) down its plan."""
        job = jobs.make(self.rt.policy, kind, body)
        if job.typed is not None:
            d = await self.decide(job.typed.question, None, ctx)
            reply = typed.completion(job.typed, d, job.requested, ctx.request_id, decisions.body(d, ctx.request_id))
            return Outcome(typed=reply, decision=d, stream=job.stream)
        return await (self.rt.serve or serve)(self.rt, job, ctx)

    async def decide(
        self, q: Question, overrides: Overrides | None, ctx: Context, plan: decisions.Plan | None = None
    ) -> Decision:
        """The cascade's decision on one typed question (``plan``: the request's, made once at its
        door; None: made here for the context's key)."""
        p = plan if plan is not None else decisions.plan(self.rt, ctx.key)
        d = await ctx.waited(decisions.make(self.rt, p, q, overrides, ctx, self.serve_tier))
        if self.rt.noted is not None:  # the quality watch's record (and shadow check) of it
            self.rt.noted(self.rt, q, d, ctx, self.serve_tier)
        return d

    async def decide_many(
        self, items: Sequence[tuple[Question, Overrides | None]], ctx: Context, plan: decisions.Plan | None = None
    ) -> list[Decision | Exception]:
        """Several questions, answers in order (an item that fails is its error)."""
        p = plan if plan is not None else decisions.plan(self.rt, ctx.key)
        out = await ctx.waited(decisions.make_many(self.rt, p, list(items), ctx, self.serve_tier))
        if self.rt.noted is not None:
            for i, d in enumerate(out):
                if isinstance(d, Decision):
                    self.rt.noted(self.rt, items[i][0], d, ctx.item(i), self.serve_tier)
        return out

    async def embed(self, body: dict[str, Any], ctx: Context) -> Outcome:
        """Embeddings of a request's body: the encoder's, or a policy model's engine's."""
        return Outcome(served=await ctx.waited(embeddings.embed(self.rt, body, ctx)))

    async def serve_tier(self, body: Body, ctx: Context) -> Served:
        """A model tier's question, served by its model's plan (the port the cascade's tiers get)."""
        return await pipeline.serve_chat(self.rt, body, ctx)


async def serve(rt: Runtime, job: Job, ctx: Context) -> Outcome:
    """The generate path's core: an untyped job served down its plan (the layers wrap this)."""
    served = await ctx.waited(pipeline.serve_plan(rt, job, ctx))
    if served.completion is not None:
        served.completion.body["model"] = served.model
    return Outcome(served=served, stream=job.stream)
