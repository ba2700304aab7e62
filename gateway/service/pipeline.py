"""An untyped job served: the encoder's pick for a semantic or routed virtual model (then that
model's chain), or the plan's own chain for a model or an alias. A typed question never comes
here: :class:`gateway.service.service.Service` gives it to the cascade."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.base import Body, Kind
from gateway.service import fitting
from gateway.service import job as jobs
from gateway.service.context import Context
from gateway.service.dispatch import dispatch
from gateway.service.job import Job, Served
from gateway.service.runtime import Runtime
from policies.errors import InvalidRequest
from policies.fit import Shape, shape_of
from policies.plans import ChainPlan, EncoderPlan, SplitPlan, TypedPlan, resolve, split_target
from policies.rollouts import GuardSpec, primary_of, without
from policies.schema import Policy, RoutedModel, SplitModel
from policies.semantic import Route


async def serve_plan(rt: Runtime, job: Job, ctx: Context) -> Served:
    """An untyped job dispatched: the encoder's pick (then that model's chain), or its plan's chain;
    a model that cannot take what the job needs (its ``shape``) is skipped."""
    plan = job.plan
    assert plan is not None, "a generating job has a plan"
    split = None
    if isinstance(plan, SplitPlan):  # one target by weight, sticky per caller; then its own plan
        name = plan.name
        target, plan = split_choice(rt, plan, job.body, ctx)
        split = f"{name}={target}"
    route = await route_of(rt, plan, job.kind, dict(job.body), job.shape) if isinstance(plan, EncoderPlan) else None
    chain = resolve(rt.policy, route.model).chain if route is not None else plan.chain
    served = await dispatch(rt, job, ctx, chain, route)
    served.split = split
    return served


def split_choice(
    rt: Runtime, plan: SplitPlan, body: Mapping[str, Any], ctx: Context
) -> tuple[str, ChainPlan | EncoderPlan]:
    """A split's target for this request (its share of a rolled-back candidate going to the
    primary: ``policies.rollouts.without``), and that target's plan."""
    targets = plan.targets
    gone = rt.watch.guard.gone(plan.name) if rt.watch is not None else None
    if gone:
        targets = without(targets, gone, primary_of(targets, guard_of(rt.policy, plan.name)))
    target = split_target(plan, sticky_id(plan.sticky, body, ctx), targets)
    chosen = resolve(rt.policy, target)
    assert isinstance(chosen, ChainPlan | EncoderPlan), "validated: a split's targets are models or routers"
    return target, chosen


def guard_of(policy: Policy, name: str) -> GuardSpec | None:
    vm = policy.virtual_models.get(name)
    return vm.guard if isinstance(vm, SplitModel) else None


def sticky_id(sticky: str, body: Mapping[str, Any], ctx: Context) -> str | None:
    """What keeps a caller on one target of a split (None: drawn anew): the request's `user`
    field, its key, its `x-session-id` header, as the split's ``sticky`` says (each falling back
    to the next: session, user, key)."""
    if sticky == "none":
        return None
    key = f"key:{ctx.key.sha256 or ctx.key.name}" if ctx.key is not None else None
    if sticky == "key":
        return key
    user = body.get("user")
    user_id = f"user:{user}" if isinstance(user, str) and user else None
    if sticky == "session" and ctx.session:
        return f"session:{ctx.session}"
    return user_id or key


async def serve_chat(rt: Runtime, body: Body, ctx: Context) -> Served:
    """A chat body whose model is no cascade model, served (a model tier's question: its model's
    chain, or the learned router's pick)."""
    plan = resolve(rt.policy, body["model"])
    if isinstance(plan, TypedPlan):
        raise InvalidRequest(f"'{plan.name}' is a cascade model: it cannot answer a cascade's tier", param="model")
    return await serve_plan(rt, jobs.internal("chat", body, plan, shape_of("chat", body)), ctx)


async def route_of(rt: Runtime, plan: EncoderPlan, kind: Kind, body: Body, shape: Shape | None) -> Route:
    """The encoder's route for a semantic or routed virtual model (a routed model chooses among the
    candidates that can take the request)."""
    assert rt.encoding is not None, "a semantic or routed model without a classifier fails validation"
    vm = plan.model
    if isinstance(vm, RoutedModel):
        barred: list[str | None] = [None] * len(vm.candidates)
        if shape is not None:
            barred = [await fitting.refusal(rt, c.model, shape) for c in vm.candidates]
        head, probe = rt.quality[plan.name], rt.probe(plan.name)
        return await rt.encoding.route_quality(rt.policy, vm, head, kind, body, barred, probe)
    if plan.reasoning is None:
        return await rt.encoding.route(vm, kind, body)
    name, router = plan.reasoning  # `reasoning: {mode: router}`: that routed model switches reasoning
    return await rt.encoding.route(vm, kind, body, (rt.policy, router, rt.quality[name]))
