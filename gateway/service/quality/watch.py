"""The gateway's watch on its own quality (policy: ``quality``; the estimates: ``policies.quality``).

Every typed decision and every answer of a routed virtual model leaves a small record (who asked,
which tier or model answered, whether that was the top, its cost), buffered and written to the
quality store in batches off the request's path. Where the cascade or the routed model has
``shadow``, a sampled share of the requests answered below the top is asked of the top too, in
the background: never on the request's path, under a money budget per day and a cap on calls in
flight (past either, sampling pauses and a counter says so), at the operator's cost (no key is
charged). Each check is a *pair* in the store. Feedback (``POST /v1/feedback``) lands beside the
records. Every ``check_every_s`` the watch reads the store's counts over its window and
recomputes the estimates; a slice whose share of the top's answers kept is, at the interval's upper
bound, under ``quality.target`` is *drifting*: a log event when it starts and ends, a gauge, and a
line in ``/ready``'s detail.

The budget is held by reserving each shadow call's upper cost before it is sent (its prompt's
characters as tokens, its ``max_tokens`` as output, or the dearest call seen so far if more) and
settling the real cost after: a day's shadow spend never passes ``budget_per_day`` (per gateway
process: each keeps its own, so a fleet of N spends at most N times it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import structlog

from backends.base import Body
from gateway.service.context import Context
from gateway.service.quality.guard import Guard
from gateway.state.quality import Pair, QualityStore, Record
from gateway.state.stores import StoreDown
from policies import quality, spend
from policies.quality import QualitySpec, ShadowSpec
from policies.rollouts import MirrorSpec
from policies.schema import ModelSpec

log = structlog.get_logger("triage.quality")

FLUSH_S = 0.5  # how often buffered records are written
FLUSH_ROWS = 256  # ...or as soon as this many wait
PRUNE_S = 3600.0  # how often records past retention are deleted
SHADOW = "shadow"  # the surface of a shadow call's context (logs)
LATENCIES = 512  # a mirror's latencies kept for its report


class Watch:
    """Records, shadow checks, feedback and the estimates drawn from them (one per gateway process)."""

    name = "quality"  # for the runtime holder's log when a reload drops it

    def __init__(self, spec: QualitySpec, store: QualityStore, now: Callable[[], float] = time.time) -> None:
        self.spec = spec
        self.store = store
        self.now = now
        self._buffer: list[Record] = []
        self._spent: dict[str, tuple[str, float]] = {}  # model -> (UTC day, money spent and reserved)
        self._dearest: dict[str, float] = {}  # model -> the dearest shadow call seen
        self._in_flight: Counter[str] = Counter()
        self.results: Counter[tuple[str, str]] = Counter()  # (model, result) -> shadow checks
        self.shadow_cost: dict[str, float] = {}  # model -> money
        self.feedback_given: Counter[str] = Counter()  # verdict (or "score") -> feedback accepted
        self.estimates: list[quality.Estimate] = []
        self.drift: list[quality.Drift] = []
        self.store_problem: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._pruned = 0.0
        self.guard = Guard(now)
        self.latencies: dict[str, deque[float]] = {}  # mirror model -> its calls' latencies, seconds

    # -- records ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self._run())

    def note(self, record: Record) -> None:
        """One answered request, written with the next batch."""
        self._buffer.append(record)
        if len(self._buffer) >= FLUSH_ROWS:
            self.later(self.flush())

    async def flush(self) -> None:
        rows, self._buffer = self._buffer, []
        if not rows:
            return
        try:
            await self.store.record(rows)
            self.store_problem = None
        except StoreDown as exc:  # the answers are given: say what was not kept
            self.store_problem = exc.message
            log.error("quality_records_lost", records=len(rows), error=exc.message)

    # -- shadow checks -----------------------------------------------------------------------

    def admit(self, model: str, spec: ShadowSpec | MirrorSpec, reserve: float) -> float | None:
        """Whether to check this request: sampled, then within the day's budget and the cap on
        calls in flight. Admitted: the reservation taken (``reserve``, or the dearest check seen if
        more), which the check's end gives back against its real cost; else None."""
        if random.random() >= spec.sample:
            return None
        if self._in_flight[model] >= spec.concurrency:
            self.results[(model, "paused_concurrency")] += 1
            return None
        reserve = max(reserve, self._dearest.get(model, 0.0))
        day = spend.day(self.now())
        seen_day, spent = self._spent.get(model, (day, 0.0))
        spent = spent if seen_day == day else 0.0
        if spent + reserve > spec.budget_per_day:
            self.results[(model, "paused_budget")] += 1
            return None
        self._spent[model] = (day, spent + reserve)
        self._in_flight[model] += 1
        return reserve

    def spent_today(self, model: str) -> float:
        day, spent = self._spent.get(model, ("", 0.0))
        return spent if day == spend.day(self.now()) else 0.0

    def check(
        self,
        model: str,
        spec: ShadowSpec,
        reserve: float,
        record: Record,
        kept: str,
        top: Callable[[], Awaitable[tuple[str, float]]],
        same: Callable[[str, str], Awaitable[bool]],
    ) -> None:
        """A shadow check of ``record`` (kept answer ``kept``) in the background, if admitted:
        ``top()`` asks the top and gives its answer and cost; ``same`` says whether two agree."""
        held = self.admit(model, spec, reserve)
        if held is None:
            return
        self.later(self._check(model, spec, held, record, kept, top, same))

    async def _check(
        self,
        model: str,
        spec: ShadowSpec,
        reserve: float,
        record: Record,
        kept: str,
        top: Callable[[], Awaitable[tuple[str, float]]],
        same: Callable[[str, str], Awaitable[bool]],
    ) -> None:
        cost = 0.0
        try:
            try:
                answer, cost = await asyncio.wait_for(top(), spec.timeout_s)
            except Exception as exc:  # a failed or slow check never reaches the caller: counted, logged
                self.results[(model, "failed")] += 1
                log.warning("shadow_failed", model=model, request_id=record.request_id, error=repr(exc)[:300])
                return
            agree = await same(kept, answer)
            self.results[(model, "agree" if agree else "disagree")] += 1
            await self.keep_pair(model, Pair(record.request_id, self.now(), kept, answer, agree, cost))
        finally:
            self.release(model, reserve, cost)

    async def keep_pair(self, model: str, pair: Pair) -> None:
        """A check's pair written now (a store that fails loses it: logged)."""
        self.shadow_cost[model] = self.shadow_cost.get(model, 0.0) + pair.cost
        self._dearest[model] = max(self._dearest.get(model, 0.0), pair.cost)
        try:
            await self.store.pair(pair)
        except StoreDown as exc:
            log.error("quality_pair_lost", model=model, request_id=pair.request_id, error=exc.message)

    def release(self, model: str, reserve: float, cost: float) -> None:
        """A check admitted by :meth:`admit` is over: its place in flight freed, its reservation
        settled against what it cost."""
        self._in_flight[model] -= 1
        day, spent = self._spent.get(model, ("", 0.0))
        if day == spend.day(self.now()):
            self._spent[model] = (day, max(0.0, spent - reserve + cost))

    def timed(self, model: str, seconds: float) -> None:
        """A mirrored call's latency (the last :data:`LATENCIES` per model, for the report)."""
        self.latencies.setdefault(model, deque(maxlen=LATENCIES)).append(seconds)

    def latency_report(self) -> dict[str, dict[str, float | int]]:
        out: dict[str, dict[str, float | int]] = {}
        for model, seen in sorted(self.latencies.items()):
            ordered = sorted(seen)
            if ordered:
                out[model] = {
                    "calls": len(ordered),
                    "p50_ms": round(1000 * ordered[len(ordered) // 2], 3),
                    "p95_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3),
                }
        return out

    # -- feedback and what the operator reads -----------------------------------------------

    async def feedback(self, request_id: str, owner: str | None, verdict: str | None, score: float | None) -> bool:
        """A caller's verdict on its own request; False when no such request of this caller is recorded."""
        await self.flush()  # a request answered a moment ago may still be in the buffer
        found = await self.store.feedback(request_id, owner, self.now(), verdict, score)
        if found:
            self.feedback_given["score" if verdict is None else verdict] += 1
        return found

    async def report(self) -> dict[str, Any]:
        """The estimates, fresh from the store, with the shadow counters of this process."""
        await self.flush()
        found = await self._estimate()
        return {
            "window_s": self.spec.window_s,
            "target": self.spec.target,
            "estimates": [e.as_dict() for e in found],
            "drift": [
                {"model": d.model, "slice": d.slice or None, "kind": d.kind, "reason": d.reason} for d in self.drift
            ],
            "shadow": {f"{m}/{r}": n for (m, r), n in sorted(self.results.items())},
            "shadow_cost_today": {m: round(self.spent_today(m), 6) for m in sorted(self._spent)},
            "rollbacks": self.guard.report(),
            "mirror_latency": self.latency_report(),
        }

    async def _estimate(self) -> list[quality.Estimate]:
        now = self.now()
        rows = [quality.Counts(**dataclasses.asdict(r)) for r in await self.store.counts(now - self.spec.window_s)]
        recent = [
            quality.Counts(**dataclasses.asdict(r)) for r in await self.store.counts(now - self.spec.mix_recent_s)
        ]
        found = quality.estimates(rows)
        self.estimates = found
        moved = quality.mix_drift(
            quality.mix(rows), quality.mix(recent), self.spec.mix_drift, self.spec.mix_min_records
        )
        self._judge(found, moved)
        return found

    def _judge(self, found: list[quality.Estimate], moved: list[quality.Drift]) -> None:
        drifting = quality.quality_drift(found, self.spec.target, self.spec.min_pairs) + moved
        was = {(d.label, d.kind) for d in self.drift}
        now = {(d.label, d.kind) for d in drifting}
        for d in drifting:
            if (d.label, d.kind) not in was:
                log.warning("quality_drift", model=d.model, slice=d.slice or None, kind=d.kind, reason=d.reason)
        for label, kind in was - now:
            log.info("quality_drift_over", slice=label, kind=kind)
        self.drift = drifting

    async def _run(self) -> None:
        last_check = 0.0
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()
            t = time.monotonic()
            if t - last_check < self.spec.check_every_s:
                continue
            last_check = t
            try:
                await self._estimate()
                await self.guard.judge(self.store)
                if t - self._pruned > PRUNE_S:
                    self._pruned = t
                    await self.store.prune(self.now() - self.spec.retention_s)
                self.store_problem = None
            except StoreDown as exc:
                self.store_problem = exc.message
                log.error("quality_store_down", error=exc.message)

    def later(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settled(self, timeout_s: float = 10.0) -> None:
        """Until the shadow checks started are done and the buffer is written (tests, shutdown)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        await self.flush()

    async def close(self) -> None:
        await self.settled()
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        await self.store.close()


def reserve(spec: ModelSpec | None, prompt_chars: int, max_tokens: int) -> float:
    """The upper cost of one call: every prompt character a token, ``max_tokens`` out."""
    if spec is None:
        return 0.0
    return spend.cost(spec.prices, {"prompt_tokens": prompt_chars, "completion_tokens": max_tokens})


def body_chars(body: Body) -> int:
    """The characters of a chat or completion body's text (a bound on its prompt tokens)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, Mapping) else None
        total += len(content) if isinstance(content, str) else len(str(content or ""))
    return total


def ctx_for(request_id: str) -> Context:
    """The context of a shadow call: its own id (the request's, marked), no key (the operator pays)."""
    return Context(f"{request_id}-shadow", surface=SHADOW)
