"""One request's bookkeeping at the edge: runtime pin, concurrency slot, what answered, the log
event and the metrics.

The service's :class:`~gateway.service.service.Outcome` is recorded once (:meth:`Exchange.record`);
``finish`` runs exactly once, when the last byte has gone (or the request failed), whether the
answer was a JSON body or a stream.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from backends.base import Attempt, Stopwatch
from gateway.obs import logs, tracing
from gateway.obs.metrics import Metrics
from gateway.obs.recent import Seen, summary
from gateway.service.cache import response as response_cache
from gateway.service.context import Context, Wait
from gateway.service.keys import metering, quotas
from gateway.service.runtime import Runtime, RuntimeHolder
from gateway.service.service import Outcome, Service
from policies import spend
from policies.cascade import CascadeExhausted, Decision
from policies.errors import RateLimited, TriageError
from policies.plans import public_models
from policies.schema import ApiKey
from policies.semantic import Route

log = structlog.get_logger("triage.request")
_PREFIX = uuid.uuid4().hex[:12]  # per process; ids are unique without a syscall per request
_COUNTER = itertools.count(1)


def _next_id() -> str:
    return f"{_PREFIX}{next(_COUNTER):012x}"


@dataclass
class ConcurrencyGate:
    """The in-flight counter behind the 429."""

    in_flight: int = 0

    def enter(self, limit: int) -> None:
        if self.in_flight >= limit:
            raise RateLimited(f"Too many requests in flight (limit {limit}); retry shortly")
        self.in_flight += 1


@dataclass
class Exchange:
    holder: RuntimeHolder
    metrics: Metrics
    gate: ConcurrencyGate
    endpoint: str
    request_id: str
    rt: Runtime
    watch: Stopwatch = field(default_factory=Stopwatch)
    attempts: list[Attempt] = field(default_factory=list)
    model: str | None = None
    served: str | None = None
    backend: str | None = None
    replica: str | None = None
    stream: bool = False
    usage: dict[str, Any] | None = None
    prompt: Any = None
    route: Route | None = None
    split: str | None = None  # a split virtual model's choice ("name=target")
    fallbacks: tuple[tuple[str, str], ...] = ()  # models that failed before the one that served, and why
    decision: Decision | None = None
    key: ApiKey | None = None  # the key that called (its name is logged, never the key)
    cost: float | None = None
    charges: list[tuple[str, Mapping[str, int] | None, float]] = field(default_factory=list)  # typed: per model tier
    cache: response_cache.Note | None = None  # what the response cache did
    meter: metering.StreamMeter | None = None  # a stream's count (what it used, what was written as it ran)
    _slot: bool = False
    _done: bool = False

    @classmethod
    def begin(
        cls, holder: RuntimeHolder, metrics: Metrics, gate: ConcurrencyGate, endpoint: str, request_id: str | None
    ) -> Exchange:
        return cls(holder, metrics, gate, endpoint, request_id or _next_id(), holder.acquire())

    @property
    def service(self) -> Service:
        return Service(self.rt)

    def context(self, wait: Wait | None = None) -> Context:
        """The service's context for this request (its upstream attempts are this exchange's)."""
        return Context(self.request_id, self.attempts, self.key, self.endpoint, wait=wait)

    def record(self, outcome: Outcome) -> None:
        """What answered: the decision (charged per tier it asked), or the engine or encoder that
        served, its route and, for a whole answer, its usage and cost (a stream's come at its end)."""
        self.stream = outcome.stream
        if outcome.decision is not None:
            self.decided(outcome.decision)
            return
        served = outcome.served
        assert served is not None
        self.route, self.split, self.fallbacks = served.route, served.split, served.fallbacks
        self.served, self.backend, self.replica = served.model, served.backend, served.replica
        self.cache = outcome.cache
        if outcome.cache is not None and outcome.cache.result == "hit":  # no engine asked: its share of the price
            self.cost = outcome.cache.charged
            self.charges = [response_cache.charge(served.model, outcome.cache)]
            return
        if served.completion is not None:
            usage = served.completion.body.get("usage")
            self.usage = usage if isinstance(usage, dict) else None
            self.cost = quotas.price(self.rt, served.model, self.usage)

    def metered(self, meter: metering.StreamMeter) -> None:
        """A relayed stream's count, at its end: its usage (the engine's, or the estimate) and cost.
        A cache hit is charged as recorded (no engine ran)."""
        if self.served is None or (self.cache is not None and self.cache.result == "hit"):
            return
        self.meter, self.usage = meter, meter.usage()
        self.cost = quotas.price(self.rt, self.served, self.usage)

    def decided(self, *decisions: Decision) -> None:
        """Typed decisions this request answered (one: it is the request's): every model tier they
        asked is charged at its model's prices, escalated and failed ones too."""
        if len(decisions) == 1:
            d = decisions[0]
            self.decision, self.served, self.usage = d, d.tier, dict(d.usage or {}) or None
        for d in decisions:
            self.charges += spend.decision_charges(self.rt.policy.models, d)
        self.cost = sum(c for *_, c in self.charges)

    def take_slot(self) -> None:
        self.gate.enter(self.rt.policy.limits.max_concurrency)
        self._slot = True
        self.metrics.in_flight.inc()

    async def finish(self, status: int, error: TriageError | None = None) -> None:
        if self._done:
            return
        self._done = True
        if self._slot:
            self.gate.in_flight -= 1
            self.metrics.in_flight.dec()
        owed: list[tuple[str, Mapping[str, int] | None, float]] = []
        try:
            if status < 400 or self.meter is not None:  # a stream that started is charged what it relayed
                owed = self._charges()
            elif isinstance(error, CascadeExhausted):  # no answer, but the tiers it asked were paid for
                owed = self.charges = spend.trace_charges(self.rt.policy.models, error.trace)
                self.cost = sum(c for *_, c in owed)
            self._report(status, error)
        finally:
            if any(quotas.writes(self.key, usage, cost) for _, usage, cost in owed):
                # counted after the answer, off its path; the runtime (and its store) stays pinned until done
                self.holder.later(self._settle(owed))
            else:
                await self.holder.release(self.rt)

    @staticmethod
    def logs_event(status: int) -> bool:
        """Whether finishing with ``status`` writes the request's log event."""
        return status >= 500 or logs.emits(logging.INFO)

    def _charges(self) -> list[tuple[str, Mapping[str, int] | None, float]]:
        """What this request is charged: each model tier a decision asked, or the model that served."""
        if self.charges or self.decision is not None:
            return self.charges
        if self.served is None:
            return []
        if self.cost is None:
            self.cost = quotas.price(self.rt, self.served, self.usage)
        if self.meter is not None:  # less what a limited key's stream wrote as it ran
            return [(self.served, *self.meter.rest(self.usage, self.cost))]
        return [(self.served, self.usage, self.cost)]

    async def _settle(self, owed: list[tuple[str, Mapping[str, int] | None, float]]) -> None:
        try:
            for model, usage, cost in owed:
                await quotas.record(self.rt, self.key, model, usage, cost)
        finally:
            await self.holder.release(self.rt)

    def _report(self, status: int, error: TriageError | None) -> None:
        latency = self.watch.elapsed()
        known = self.model if self.model is not None and self.model in public_models(self.rt.policy) else None
        model = self.served or (known if known is not None else "-")  # no label per unknown name sent
        self.metrics.observe(self.endpoint, model, status, latency, self.attempts, self.usage)
        if error is not None:
            self.metrics.errors.labels(error.type, str(status)).inc()
        if self.cache is not None:
            self.metrics.cache.labels(self.cache.result).inc()
            if self.cache.result == "hit" and self.cache.price > self.cache.charged:
                self.metrics.cache_saved.inc(self.cache.price - self.cache.charged)
        if self.decision is not None:
            self.metrics.decisions.labels(self.decision.tier, self.decision.qtype).inc()
        if self.cost:
            who = self.key.name if self.key is not None else "-"
            for charged, cost in [(m, c) for m, _, c in self.charges] or [(model, self.cost)]:
                self.metrics.spend.labels(who, charged).inc(cost)
        self._remember(status, latency, error)
        if not self.logs_event(status) and not tracing.recording():
            return  # nobody reads the event: not built
        event: dict[str, Any] = {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "served_model": self.served,
            "backend": self.backend,
            "replica": self.replica,
            "stream": self.stream,
            "status": status,
            "latency_ms": round(latency * 1000, 3),
            "attempts": [
                {"backend": a.backend, "replica": a.replica, "outcome": a.outcome, "ms": round(a.latency_s * 1000, 3)}
                for a in self.attempts
            ],
        }
        if self.route is not None:
            event["route"] = asdict(self.route)
        if self.split is not None:
            event["split"] = self.split
        if self.fallbacks:
            event["fallbacks"] = [{"model": m, "error_class": why} for m, why in self.fallbacks]
        if self.cache is not None:
            event["cache"] = self.cache.event()
        if self.decision is not None:
            event["decision"] = self._decision_event(self.decision)
        if self.key is not None:
            event["key"] = self.key.name
        if self.cost:
            event["cost"] = round(self.cost, 8)
        if self.usage:
            event["prompt_tokens"] = self.usage.get("prompt_tokens")
            event["completion_tokens"] = self.usage.get("completion_tokens")
            if self.meter is not None and self.meter.estimated:
                event["usage_estimated"] = True  # the engine reported none: counted from what was relayed
        if error is not None:
            event["error"] = {"type": error.type, "code": error.code, "message": error.message}
        if self.prompt is not None and self.rt.policy.logging.log_prompts:
            event["prompt"] = self.prompt
        tracing.annotate(event)  # on the request's span, when traced
        (log.warning if status >= 500 else log.info)("request", **event)

    def _remember(self, status: int, latency_s: float, error: TriageError | None) -> None:
        """The request in the console's ring (policy: ``console``)."""
        console = self.rt.policy.console
        if not console.enabled or (self.key is None and self.rt.keys_required):
            return  # a request without a valid key keeps nothing: it cannot push real ones out
        recent = self.metrics.recent
        recent.bound(console.recent, console.recent_bytes, console.prompt_chars)
        show = self.rt.policy.logging.log_prompts
        recent.add(
            seen := Seen(
                self.request_id,
                time.time(),
                self.endpoint,
                self.model,
                self.served,
                status,
                latency_s * 1000,
                self.stream,
                self.key.name if self.key is not None else None,
                self.cost,
                spend.always_top(self.rt.policy, self.model, self.decision, self.usage) if status < 400 else None,
                self.usage,
                error.type if error is not None else None,
                self.decision,
                self.route,
                self.attempts,
                self.prompt if show else None,
                show,
            )
        )
        if self.rt.recent is not None:  # the fleet's ring (Redis): written in the background, in batches
            self.rt.recent.push(summary(seen, console.recent_bytes // console.recent))

    def _decision_event(self, d: Decision) -> dict[str, Any]:
        """The cascade's decision for the log: answers (user text) only when prompts are logged."""
        show = self.rt.policy.logging.log_prompts
        steps = [{k: v for k, v in s.as_dict().items() if show or k != "answer"} for s in d.trace]
        return {
            "tier": d.tier,
            "confidence": round(d.confidence, 6),
            "trace": steps,
            **({"answer": d.answer} if show else {}),
        }
