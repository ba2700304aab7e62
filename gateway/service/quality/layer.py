"""The quality watch as a layer around the generate path (composed once at assembly:
:func:`gateway.service.assemble.build`): a routed model's answer is recorded, and sampled for a
shadow check against its reference candidate (:func:`gateway.service.quality.shadow.routed`).
Typed decisions are recorded where they are made (:meth:`gateway.service.service.Service.decide`)."""

from __future__ import annotations

from gateway.service.context import Context
from gateway.service.job import Job, Outcome, Serve
from gateway.service.quality import shadow
from gateway.service.runtime import Runtime
from gateway.service.tier_answers import ServeChat
from policies.cascade import Decision, Question
from policies.plans import EncoderPlan
from policies.schema import RoutedModel


def watched(inner: Serve) -> Serve:
    """``inner`` with a routed model's answers recorded and checked."""

    async def serve(rt: Runtime, job: Job, ctx: Context) -> Outcome:
        out = await inner(rt, job, ctx)
        plan, watch = job.plan, rt.watch
        if watch is None or not isinstance(plan, EncoderPlan) or not isinstance(plan.model, RoutedModel):
            return out
        assert out.served is not None and job.shape is not None
        shadow.routed(rt, watch, plan, job.kind, dict(job.body), out.served, ctx, job.shape)
        return out

    return serve


def noted(rt: Runtime, q: Question, d: Decision, ctx: Context, serve_chat: ServeChat) -> None:
    """A typed decision recorded (and sampled for a check against the top tier), where it is made."""
    if rt.watch is not None:
        shadow.decided(rt, rt.watch, q, d, ctx, serve_chat)
