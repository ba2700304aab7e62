"""The quality watch as a layer around the generate path (composed once at assembly:
:func:`gateway.service.assemble.build`):

- a routed model's answer is recorded, and sampled for a shadow check against its reference
  candidate (:func:`gateway.service.quality.shadow.routed`);
- a guarded or shadowed split's request is recorded with its target and how it ended, a
  candidate's answer sampled for a check against the primary, and its target chosen here with
  the guard's rollbacks (:mod:`gateway.service.quality.rollout`);
- a mirrored model's request is sampled and asked of the mirror's candidate in the background.

Typed decisions are recorded where they are made (:meth:`gateway.service.service.Service.decide`)."""

from __future__ import annotations

import dataclasses

from gateway.service import pipeline
from gateway.service.context import Context
from gateway.service.job import Job, Outcome, Serve
from gateway.service.quality import rollout, shadow
from gateway.service.runtime import Runtime
from gateway.service.tier_answers import ServeChat
from policies.cascade import Decision, Question
from policies.plans import EncoderPlan, SplitPlan
from policies.schema import RoutedModel, SplitModel


def watched(inner: Serve) -> Serve:
    """``inner`` with a routed model's answers, a watched split's requests and a mirrored model's
    answers recorded and checked."""

    async def serve(rt: Runtime, job: Job, ctx: Context) -> Outcome:
        watch = rt.watch
        if watch is None:
            return await inner(rt, job, ctx)
        split = None
        if isinstance(job.plan, SplitPlan) and _watched_split(rt, job.plan.name):
            name = job.plan.name
            target, chosen = pipeline.split_choice(rt, job.plan, job.body, ctx)
            split = (name, target)
            job = dataclasses.replace(job, plan=chosen)
        try:
            out = await inner(rt, job, ctx)
        except BaseException as exc:
            if split is not None:
                rollout.split_served(rt, watch, *split, job, None, exc, ctx)
            raise
        served = out.served
        if served is None:  # a cache hit is answered before the watch: nothing reaches here without an answer
            return out
        if split is not None:
            served.split = f"{split[0]}={split[1]}"
            rollout.split_served(rt, watch, *split, job, served, None, ctx)
        plan = job.plan
        if isinstance(plan, EncoderPlan) and isinstance(plan.model, RoutedModel):
            assert job.shape is not None
            shadow.routed(rt, watch, plan, job.kind, dict(job.body), served, ctx, job.shape)
        mirror = rt.policy.mirrors.get(job.requested)
        if mirror is not None:
            rollout.mirror(rt, watch, job.requested, mirror, job, served, ctx)
        return out

    return serve


def _watched_split(rt: Runtime, name: str) -> bool:
    vm = rt.policy.virtual_models.get(name)
    return isinstance(vm, SplitModel) and (vm.guard is not None or vm.shadow is not None)


def noted(rt: Runtime, q: Question, d: Decision, ctx: Context, serve_chat: ServeChat) -> None:
    """A typed decision recorded (and sampled for a check against the top tier), where it is made."""
    if rt.watch is not None:
        shadow.decided(rt, rt.watch, q, d, ctx, serve_chat)
