"""What the quality watch records of a split's requests and of a mirrored model's (the rules:
``policies.rollouts``), off the request's path.

- A guarded or shadowed **split**: each request leaves a record (``kind`` split, ``answered_by``
  its target, ``slice`` ok or error: the target failed, whether the caller got an error or a
  fallback's answer); a sampled share of the candidates' whole answers is asked of the primary
  too (``shadow``), the pair kept as a routed model's is. The guard reads these.
- A **mirror**: a sampled share of the requests that name a mirrored model is asked of its
  candidate in the background, once the caller's answer is whole (a stream: at its end). The
  caller's answer, and what its key is charged, are the primary's alone; the candidate's call has
  no key (the operator pays, within the mirror's budget). Each mirrored request leaves a record
  under ``mirror:<name>`` (``slice`` ok or error) and, when the candidate answered, a pair: the
  primary's answer beside the candidate's, and whether the two agree; its latency is kept by the
  watch for the report and the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import orjson
import structlog

from backends.base import Body, ChunkStream, Kind
from gateway.service import job as jobs
from gateway.service import pipeline
from gateway.service.cache import response as response_cache
from gateway.service.context import Context
from gateway.service.job import Served
from gateway.service.keys import quotas
from gateway.service.quality import shadow, watch
from gateway.state.quality import Pair, Record
from policies import response_cache as assembly
from policies import rollouts
from policies.errors import NotReady, TriageError, UpstreamError
from policies.fit import Shape
from policies.plans import ChainPlan, TypedPlan, resolve
from policies.response_cache import last_user_text
from policies.rollouts import MirrorSpec
from policies.schema import SplitModel

if TYPE_CHECKING:
    from gateway.service.runtime import Runtime

log = structlog.get_logger("triage.quality")


def failed_there(exc: BaseException | None, served: Served | None, target: str) -> bool:
    """Whether ``target`` failed this request: the error it ended in is the upstream's (not the
    caller's: a bad request, its key's limits, a client that left), or a fallback answered after
    ``target`` failed."""
    if exc is not None:  # a cancelled request (its client left) is nobody's failure
        return isinstance(exc, Exception) and (
            isinstance(exc, UpstreamError | NotReady) or not isinstance(exc, TriageError)
        )
    return served is not None and any(m == target for m, _ in served.fallbacks)


def split_served(
    rt: Runtime,
    w: watch.Watch,
    name: str,
    target: str,
    job: jobs.Job,
    served: Served | None,
    exc: BaseException | None,
    ctx: Context,
) -> None:
    """Record a guarded or shadowed split's request; a candidate's whole answer sampled for a
    check against the primary."""
    vm = rt.policy.virtual_models.get(name)
    if not isinstance(vm, SplitModel) or (vm.guard is None and vm.shadow is None):
        return
    primary = vm.shadow.reference if vm.shadow is not None and vm.shadow.reference else None
    primary = primary or rollouts.primary_of(vm.targets.items(), vm.guard)
    outcome = rollouts.ERROR if failed_there(exc, served, target) else rollouts.OK
    whole = served.completion.body if served is not None and served.completion is not None else None
    cost = quotas.price(rt, served.model, whole.get("usage")) if served is not None and whole is not None else 0.0
    shown = last_user_text(dict(job.body)) if rt.policy.logging.log_prompts else None
    owner = ctx.key.sha256 if ctx.key is not None else None
    record = Record(
        ctx.request_id, time.time(), owner, name, rollouts.SPLIT, target, target == primary, outcome, cost, shown
    )
    w.note(record)
    if vm.shadow is None or target == primary or whole is None or outcome == rollouts.ERROR:
        return
    assert job.shape is not None, "a generating job has its shape"
    ask = _asker(rt, job.kind, dict(job.body), primary, job.shape, ctx.request_id)
    max_tokens = job.body.get("max_completion_tokens") or job.body.get("max_tokens") or 1024
    upper = watch.reserve(rt.policy.models.get(primary), watch.body_chars(dict(job.body)), int(max_tokens))
    w.check(name, vm.shadow, upper, record, response_cache.answer_text(whole), ask, shadow.texts_agree(rt))


def _asker(
    rt: Runtime, kind: Kind, body: Body, model: str, shape: Shape, request_id: str, alone: bool = False
) -> Callable[[], Awaitable[tuple[str, float]]]:
    """A call that asks ``model`` the same body, whole, as the operator (``alone``: that model
    only, none of its fallbacks); it gives the answer's text and cost."""
    found = resolve(rt.policy, model)
    assert not isinstance(found, TypedPlan), "validated: a split's targets and mirrors are no cascade models"
    plan = ChainPlan(model, (model,)) if alone else found
    asked = {**body, "model": model, "stream": False}
    asked.pop("stream_options", None)  # only a stream may carry them

    async def ask() -> tuple[str, float]:
        fresh = await pipeline.serve_plan(rt, jobs.internal(kind, asked, plan, shape), watch.ctx_for(request_id))
        assert fresh.completion is not None, "asked whole"
        usage = fresh.completion.body.get("usage")
        return response_cache.answer_text(fresh.completion.body), quotas.price(rt, fresh.model, usage)

    return ask


def mirror(
    rt: Runtime, w: watch.Watch, name: str, spec: MirrorSpec, job: jobs.Job, served: Served, ctx: Context
) -> None:
    """A sampled share of ``name``'s requests asked of the mirror's candidate once the caller's
    answer is whole (a stream is followed to its end; one that fails or is left is not mirrored)."""
    model = f"{rollouts.MIRROR}:{name}"
    body = dict(job.body)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 1024
    held = w.admit(model, spec, watch.reserve(rt.policy.models.get(spec.to), watch.body_chars(body), int(max_tokens)))
    if held is None:
        return
    assert job.shape is not None, "a generating job has its shape"
    ask = _asker(rt, job.kind, body, spec.to, job.shape, ctx.request_id, alone=True)
    owner = ctx.key.sha256 if ctx.key is not None else None
    shown = last_user_text(body) if rt.policy.logging.log_prompts else None
    base = Record(f"{ctx.request_id}-mirror", 0.0, owner, model, rollouts.MIRROR, spec.to, False, "", 0.0, shown)

    def start(whole: Body) -> None:
        cost = quotas.price(rt, served.model, whole.get("usage"))
        kept = response_cache.answer_text(whole)
        w.later(_mirrored(rt, w, model, spec, held, dataclasses.replace(base, cost=cost), kept, ask))

    if served.completion is not None:
        start(served.completion.body)
    elif served.stream is not None:
        served.stream = _Followed(job.kind, served.stream, start, lambda: w.release(model, held, 0.0))
    else:
        w.release(model, held, 0.0)


async def _mirrored(
    rt: Runtime,
    w: watch.Watch,
    model: str,
    spec: MirrorSpec,
    held: float,
    base: Record,
    kept: str,
    ask: Callable[[], Awaitable[tuple[str, float]]],
) -> None:
    cost, began = 0.0, time.perf_counter()
    try:
        try:
            answer, cost = await asyncio.wait_for(ask(), spec.timeout_s)
        except Exception as exc:  # never the caller's: counted, logged, recorded as the candidate's error
            w.results[(model, "failed")] += 1
            w.note(dataclasses.replace(base, at=time.time(), slice=rollouts.ERROR))
            log.warning(
                "mirror_failed", model=model, candidate=spec.to, request_id=base.request_id, error=repr(exc)[:300]
            )
            return
        w.timed(model, time.perf_counter() - began)
        agree = await shadow.texts_agree(rt)(kept, answer)
        w.results[(model, "agree" if agree else "disagree")] += 1
        w.note(dataclasses.replace(base, at=time.time(), slice=rollouts.OK))
        await w.keep_pair(model, Pair(base.request_id, time.time(), kept, answer, agree, cost))
    finally:
        w.release(model, held, cost)


class _Followed(ChunkStream):
    """A stream relayed as it comes, its chunks kept; whole at its end, ``done`` gets its answer
    (one that fails, is left or never finishes calls ``dropped`` instead)."""

    def __init__(
        self, kind: Kind, inner: ChunkStream, done: Callable[[Body], None], dropped: Callable[[], None]
    ) -> None:
        self.first, self.replica = inner.first, inner.replica
        self._kind, self._inner, self._done, self._dropped = kind, inner, done, dropped
        self._over = False

    async def __aiter__(self) -> AsyncIterator[Body]:
        seen: list[Body] = []
        try:
            async for chunk in self._inner:
                seen.append(orjson.loads(orjson.dumps(chunk)))  # as it came: the relay changes it once sent
                yield chunk
        finally:
            whole = assembly.assemble(self._kind, seen)
            self._end(whole)

    def _end(self, whole: Body | None) -> None:
        if self._over:
            return
        self._over = True
        if whole is not None:
            self._done(whole)
        else:
            self._dropped()

    async def aclose(self) -> None:
        self._end(None)
        await self._inner.aclose()
