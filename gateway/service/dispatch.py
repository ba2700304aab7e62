"""Send one job down its model chain: the model, its fallbacks, the policy's fallback.

Replica retries happen inside each backend; this moves to the next model when a backend has
given up (an upstream error or timeout). A model's ``fallbacks_on`` come first, for the reason it
failed (``policies.errors.error_class``: a context window exceeded, a rate limit, a content-policy
refusal, a timeout, a server error); then the chain goes on. A request the upstream rejected
(another 4xx, or one of those classes with no fallback of its own) is not retried. A
model that cannot take the request (its context, tools, images: ``gateway.service.fitting``) is
skipped, and said so; when none down the chain can, the request is a 400, never sent. The body
each link sends is made from the job there (:meth:`gateway.service.job.Job.upstream`).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from backends.base import Body, Call
from gateway.obs import tracing
from gateway.service import fitting
from gateway.service.context import Context
from gateway.service.job import Job, Served
from gateway.service.runtime import Runtime
from policies import reasoning
from policies.errors import UpstreamError, UpstreamRejected, error_class
from policies.fit import nothing_fits
from policies.schema import ModelSpec
from policies.semantic import Route

__all__ = ["Served", "dispatch"]  # Served is the job's (gateway.service.job), named here where it is made

log = structlog.get_logger("triage.dispatch")


async def dispatch(rt: Runtime, job: Job, ctx: Context, chain: Sequence[str], route: Route | None = None) -> Served:
    """The first model of ``chain`` that answers ``job``; ``route``, when the encoder chose the
    chain's head, switches reasoning per candidate and is kept in what is served. A model that
    cannot take what the job needs (its ``shape``; None: not checked) is skipped."""
    last: UpstreamError | UpstreamRejected | None = None
    skipped: list[tuple[str, str]] = []
    taken: list[tuple[str, str]] = []  # (model that failed, why): the fallbacks taken, for the trace
    todo = list(chain)
    i = 0
    while i < len(todo):
        name = todo[i]
        i += 1
        spec = rt.policy.models[name]
        backend = rt.backends[spec.backend]
        if job.kind == "embedding" and not backend.capabilities.embeddings:
            continue  # this backend has no embeddings API: the next model down the chain
        if job.shape is not None and (why := await fitting.refusal(rt, name, job.shape)) is not None:
            skipped.append((name, why))
            log.info("model_skipped", request_id=ctx.request_id, model=name, reason=why, next=_after(todo, i))
            continue
        upstream_body, switch = _link(rt, job, name, spec, route)
        call = Call(job.kind, upstream_body, ctx.request_id, ctx.attempts, ctx.affinity, ctx.surface == "batch")
        try:
            if call.stream:
                stream = await tracing.upstream(backend.open_stream, call, backend.name, name, chain)
                served = Served(name, backend.name, stream.replica, None, stream, route, switch, tuple(skipped))
            else:
                completion = await tracing.upstream(backend.complete, call, backend.name, name, chain)
                served = Served(name, backend.name, completion.replica, completion, None, route, switch, tuple(skipped))
            served.fallbacks = tuple(taken)
            return served
        except (UpstreamError, UpstreamRejected) as exc:
            why = error_class(exc)
            extra = [m for m in spec.fallbacks_on.get(why, []) if m not in todo[:i]] if why is not None else []
            if isinstance(exc, UpstreamRejected) and not extra:
                raise  # the request's own fault, with no fallback for its reason
            todo[i:] = extra + [m for m in todo[i:] if m not in extra]  # its reason's fallbacks come first
            taken.append((name, why or "error"))
            last = exc
            log.warning(
                "model_failed",
                request_id=ctx.request_id,
                model=name,
                backend=backend.name,
                error=exc.message,
                error_class=why,
                next=_after(todo, i),
            )
    if isinstance(last, UpstreamRejected):
        raise last
    if last is None and skipped:
        raise nothing_fits(f"the model '{job.requested}' may go to", skipped, "messages")
    if last is None:
        raise UpstreamError(f"no model down the chain of '{job.requested}' could take the request", retryable=False)
    raise last


def _link(rt: Runtime, job: Job, name: str, spec: ModelSpec, route: Route | None) -> tuple[Body, str | None]:
    """The body one link sends (the model's upstream name; a route's reasoning switch; a stream asks
    for its usage) and the switch it used."""
    body, switch = job.upstream(rt.policy.upstream_name(name)), None
    if route is not None and route.apply_reasoning:
        body, switch = reasoning.apply(body, spec, route.reasoning)
    elif route is not None:
        switch = "engine"  # the candidate leaves reasoning to the engine's default
    if job.stream and job.kind in ("chat", "completion"):
        # every stream is counted: the engine is asked for its usage whether the client did or not
        # (gateway.service.keys.metering: the client gets the usage chunk only when it asked)
        body["stream_options"] = {**(job.body.get("stream_options") or {}), "include_usage": True}
    return body, switch


def _after(todo: Sequence[str], i: int) -> str | None:
    return todo[i] if i < len(todo) else None
