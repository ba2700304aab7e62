"""The response cache as a layer around the generate path (composed once at assembly:
:func:`gateway.service.assemble.build`): a hit answers without an engine (a semantic hit is
sometimes audited against a fresh answer, off the request's path); a miss is served by the layer
within, and its answer kept (a stream's once it has ended whole)."""

from __future__ import annotations

import structlog

from gateway.service import pipeline
from gateway.service.cache import response as response_cache
from gateway.service.cache import semantic as semantic_cache
from gateway.service.context import Context
from gateway.service.job import Job, Outcome, Serve, Served
from gateway.service.keys import quotas
from gateway.service.runtime import Runtime

log = structlog.get_logger("triage.cache")


def cached(inner: Serve) -> Serve:
    """``inner`` with the policy's response cache in front of it."""

    async def serve(rt: Runtime, job: Job, ctx: Context) -> Outcome:
        body = dict(job.body)
        cache = response_cache.begin(rt, job.kind, body, ctx, job.requested)
        if cache is None:
            return await inner(rt, job, ctx)
        if (hit := await cache.find()) is not None:
            if cache.similar and cache.semantic is not None and cache.semantic.audit_due():
                cache.semantic.later(_audit(rt, cache, job, hit, ctx))
            replay = response_cache.replayed(cache, hit, ctx.request_id, job.stream, body)
            return Outcome(served=replay, stream=job.stream, cache=cache.note)
        out = await inner(rt, job, ctx)
        out.cache = cache.note
        served = out.served
        if cache.write and served is not None:
            if served.completion is None:
                out.served = cache.kept_after(served)
            else:  # kept off the request's path (a Redis write is a round trip)
                rt.later(cache.keep(served.model, served.completion.body))
        return out

    return serve


async def _audit(rt: Runtime, cache: response_cache.Lookup, job: Job, hit: Served, ctx: Context) -> None:
    """A semantic hit's answer checked against a fresh one, off the request's path, at the
    operator's cost (no key is charged): the semantic cache counts the wrong hits."""
    assert cache.semantic is not None and hit.completion is not None
    audit = Context(f"{ctx.request_id}-audit", surface="cache_audit")
    fresh = await pipeline.serve_plan(rt, job.whole(), audit)
    assert fresh.completion is not None
    said, now = response_cache.answer_text(hit.completion.body), response_cache.answer_text(fresh.completion.body)
    right = said == now or semantic_cache.agree(await cache.semantic.embed(said), await cache.semantic.embed(now))
    cost = quotas.price(rt, fresh.model, fresh.completion.body.get("usage"))
    log.info("semantic_cache_audited", request_id=ctx.request_id, right=right, model=fresh.model, cost=cost)
    cache.semantic.audited_hit(right)
