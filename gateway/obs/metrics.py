"""Prometheus metrics, one registry per app (so several apps can live in one process).

Under ``triage serve --workers N`` the workers share their metrics through prometheus-client's
multiprocess mode: the serve command points ``PROMETHEUS_MULTIPROC_DIR`` at a private folder before
the first worker starts (prometheus-client reads it when it is imported). Each worker then keeps
its counters and histograms in its own file there, and ``/metrics``, whichever worker answers,
adds up every worker's files, a dead worker's counts included, so totals never go back. The
gauges read at scrape time from a process's own objects (the admission rooms, the escalation
budget) cannot be read across processes: each worker samples them into shared gauges every
second (and the answering worker just before it renders), summed over the live workers
(``livesum``: requests in flight, waiting, holding a slot) or one series per worker (``liveall``,
a ``pid`` label: the budget, which each worker keeps for itself, and each worker's start time).
In that mode there is one app per process (the files are per process). Without the variable
(one process), metrics are what they always were.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from backends.base import Attempt
from gateway.obs.recent import Recent

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client reads it when imported; set by gateway.supervisor
SAMPLE_EVERY_S = 1.0
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_WAITING = ("triage_admission_waiting", "Requests waiting for a replica slot")
_BUSY = ("triage_admission_in_flight", "Requests holding a replica slot")
_OFFSET = ("triage_cascade_threshold_offset", "The escalation budget's shift of the first tiers' thresholds")
_TARGET = ("triage_cascade_escalation_target", "The share the budget holds")
_SHARE = ("triage_cascade_escalated_share", "Share of recent questions the first tier escalated")
_RESTARTS = ("triage_engine_restarts", "Restarts of a local engine's worker process (it died or hung)")
_UP = ("triage_engine_up", "1 while a local engine's worker serves it, 0 while it is down or restarting")


def _engines(backends: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The backends that run a local engine in a worker process (``backends.engine_host``)."""
    for name, backend in backends:
        engine = getattr(backend, "engine", None)
        if engine is not None and hasattr(engine, "host"):
            yield name, backend


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # the folder several worker processes share (set by `triage serve --workers N`), or None
        self.shared_dir: str | None = os.environ.get(MULTIPROC_ENV) or None
        self._samplers: list[Callable[[], None]] = []
        self.recent = Recent()  # the console's ring of recent requests (this process's)
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        r = self.registry
        self.requests = Counter("triage_requests", "Requests answered", ["endpoint", "model", "status"], registry=r)
        self.errors = Counter("triage_errors", "Error answers by OpenAI error type", ["type", "status"], registry=r)
        self.latency = Histogram(
            "triage_request_latency_seconds",
            "Request latency (to the last byte)",
            ["endpoint", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.attempts = Counter(
            "triage_upstream_attempts", "Tries at upstream replicas", ["backend", "replica", "outcome"], registry=r
        )
        self.tokens = Counter("triage_tokens", "Tokens reported by upstreams", ["model", "kind"], registry=r)
        self.spend = Counter(
            "triage_spend", "Cost of served requests at the policy's prices, by key name", ["key", "model"], registry=r
        )
        self.in_flight = Gauge(
            "triage_in_flight_requests", "Requests being served", registry=r, multiprocess_mode="livesum"
        )
        self.reloads = Counter("triage_policy_reloads", "Policy reloads", ["outcome"], registry=r)
        self.decisions = Counter(
            "triage_decisions", "Typed decisions by the tier that answered", ["tier", "type"], registry=r
        )
        self.cache = Counter(
            "triage_response_cache",
            "Open requests by what the response cache did (hit, miss, bypass)",
            ["result"],
            registry=r,
        )
        self.cache_saved = Counter(
            "triage_response_cache_saved",
            "What cache hits did not cost, at the answers' prices (less hit_charge)",
            registry=r,
        )
        self.started = (
            Gauge(
                "triage_worker_start_time_seconds",
                "When each worker process started serving (unix time; 0 while it starts)",
                registry=r,
                multiprocess_mode="liveall",
            )
            if self.shared_dir
            else None
        )

    def observe(
        self, endpoint: str, model: str, status: int, latency_s: float, attempts: list[Attempt], usage: dict | None
    ) -> None:
        # each request's series, found once per label set (prometheus-client's labels() checks and
        # locks on every call); the label sets are bounded by the policy's names and the statuses
        children = self._children.get((endpoint, model, status))
        if children is None:
            children = (self.requests.labels(endpoint, model, str(status)), self.latency.labels(endpoint, model))
            self._children[(endpoint, model, status)] = children
        children[0].inc()
        children[1].observe(latency_s)
        for a in attempts:
            self.attempts.labels(a.backend, a.replica, a.outcome).inc()
        if usage:
            for kind in ("prompt", "completion"):
                count = usage.get(f"{kind}_tokens")
                if isinstance(count, int) and count >= 0:
                    self.tokens.labels(model, kind).inc(count)

    def watch_backends(self, backends: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        """Gauges of the current backends: each admission waiting room's queue and its requests in
        flight per replica (read at scrape time; sampled, across workers)."""
        if self.shared_dir is None:
            self.registry.register(_AdmissionCollector(backends))
            self.registry.register(_EngineCollector(backends))
        else:
            self._samplers.append(_AdmissionSampler(backends, self.registry).sample)
            self._samplers.append(_EngineSampler(backends, self.registry).sample)
        self._samplers.append(_ReplicaSampler(backends, self.registry).sample)

    def watch_budget(self, budget: Callable[[], Any]) -> None:
        """Gauges of the current policy's escalation budget, if it has one (read at scrape time;
        sampled, across workers)."""
        if self.shared_dir is None:
            self.registry.register(_BudgetCollector(budget))
        else:
            self._samplers.append(_BudgetSampler(budget, self.registry).sample)

    def watch_quality(self, watch: Callable[[], Any]) -> None:
        """The quality watch's counters and estimates (policy: ``quality``), sampled: shadow checks
        by result, their cost, feedback, and per model and slice the estimated share of the top's
        answers kept with its interval and whether it drifts."""
        self._samplers.append(_QualitySampler(watch, self.registry).sample)

    def watch_memory(self, memory: Callable[[], tuple[Any, Any]]) -> None:
        """The cascade's memory of escalations (policy: ``cascade.memory``), sampled: the questions
        this gateway's ring holds, and what its fleet's feed wrote, read, skipped, failed or dropped."""
        self._samplers.append(_MemorySampler(memory, self.registry).sample)

    def watch_guardrails(self, guardrails: Callable[[], Any]) -> None:
        """The guardrails' tally (policy: ``guardrails``), sampled: hits per guardrail and action,
        and checks that failed or passed their deadline per guardrail and what on_error made of them."""
        self._samplers.append(_GuardrailSampler(guardrails, self.registry).sample)

    async def run(self, stop: asyncio.Event) -> None:
        """While the app serves: with workers, mark this one started and sample its live gauges
        every second until ``stop``. Nothing to do in one process."""
        if self.started is None:
            return
        self.started.set_to_current_time()
        while not stop.is_set():
            self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)

    def sample(self) -> None:
        for sample in self._samplers:
            sample()

    def render(self) -> bytes:
        if self.shared_dir is None:
            self.sample()  # the sampled series (the quality watch's)
            return generate_latest(self.registry)
        self.sample()  # this worker's own gauges, fresh; the others' are at most a second old
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.shared_dir)
        return generate_latest(merged)


class _AdmissionCollector(Collector):
    def __init__(self, backends: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self.backends = backends

    def collect(self) -> Iterator[GaugeMetricFamily]:
        waiting = GaugeMetricFamily(*_WAITING, labels=["backend"])
        busy = GaugeMetricFamily(*_BUSY, labels=["backend", "replica"])
        for name, backend in self.backends():
            room = getattr(backend, "admission", None)
            if room is None:
                continue
            waiting.add_metric([name], room.waiting)
            for r in room.replicas:
                busy.add_metric([name, r.state.api_base], r.in_flight)
        yield waiting
        yield busy


class _EngineCollector(Collector):
    def __init__(self, backends: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self.backends = backends

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        restarts = CounterMetricFamily(*_RESTARTS, labels=["backend"])
        up = GaugeMetricFamily(*_UP, labels=["backend"])
        for name, backend in _engines(self.backends()):
            restarts.add_metric([name], backend.engine.host.restarts)
            up.add_metric([name], 1.0 if backend.healthy() else 0.0)
        yield restarts
        yield up


class _BudgetCollector(Collector):
    def __init__(self, budget: Callable[[], Any]) -> None:
        self.budget = budget

    def collect(self) -> Iterator[GaugeMetricFamily]:
        b = self.budget()
        if b is None:
            return
        yield GaugeMetricFamily(*_OFFSET, b.offset)
        yield GaugeMetricFamily(*_TARGET, b.target)
        if b.share is not None:
            yield GaugeMetricFamily(*_SHARE, b.share)


class _AdmissionSampler:
    """The admission gauges as shared gauges, summed over the live workers. A room or replica that
    a reload removed reads 0 (a shared file keeps every series it ever had)."""

    def __init__(self, backends: Callable[[], Iterable[tuple[str, Any]]], registry: CollectorRegistry) -> None:
        self.backends = backends
        self.waiting = Gauge(*_WAITING, ["backend"], registry=registry, multiprocess_mode="livesum")
        self.busy = Gauge(*_BUSY, ["backend", "replica"], registry=registry, multiprocess_mode="livesum")
        self.seen: set[tuple[str, ...]] = set()

    def sample(self) -> None:
        now: dict[tuple[str, ...], float] = {}
        for name, backend in self.backends():
            room = getattr(backend, "admission", None)
            if room is None:
                continue
            now[(name,)] = room.waiting
            for r in room.replicas:
                now[(name, r.state.api_base)] = r.in_flight
        for labels in self.seen - now.keys():
            now[labels] = 0
        for labels, value in now.items():
            (self.waiting if len(labels) == 1 else self.busy).labels(*labels).set(value)
        self.seen = set(now)


class _EngineSampler:
    """The engines' restarts (counted up by what each worker saw since its last sample) and
    whether each is up, across workers."""

    def __init__(self, backends: Callable[[], Iterable[tuple[str, Any]]], registry: CollectorRegistry) -> None:
        self.backends = backends
        self.restarts = Counter(_RESTARTS[0], _RESTARTS[1], ["backend"], registry=registry)
        self.up = Gauge(*_UP, ["backend"], registry=registry, multiprocess_mode="livemin")
        self.seen: dict[int, int] = {}  # id(host) -> restarts already counted

    def sample(self) -> None:
        for name, backend in _engines(self.backends()):
            host = backend.engine.host
            counted = self.seen.get(id(host), 0)
            if host.restarts > counted:
                self.restarts.labels(name).inc(host.restarts - counted)
                self.seen[id(host)] = host.restarts
            self.up.labels(name).set(1.0 if backend.healthy() else 0.0)


class _ReplicaSampler:
    """Each pool replica as the dispatch rule sees it (``backends/replicas.py``): its load, whether
    its engine's own figures are known, and the reads of them that failed. Per worker (each reads
    the engines itself)."""

    def __init__(self, backends: Callable[[], Iterable[tuple[str, Any]]], registry: CollectorRegistry) -> None:
        self.backends = backends
        labels = ["backend", "replica"]
        self.load = Gauge(
            "triage_replica_load", "Requests on a replica as dispatch counts them", labels,
            registry=registry, multiprocess_mode="liveall",
        )  # fmt: skip
        self.known = Gauge(
            "triage_replica_signals_known", "1 while the engine's own load figures are fresh, 0 while unknown",
            labels, registry=registry, multiprocess_mode="liveall",
        )  # fmt: skip
        self.failed = Counter(
            "triage_engine_signals_failed", "Reads of an engine's metrics that gave no load (slow, absent, malformed)",
            labels, registry=registry,
        )  # fmt: skip
        self.counted: dict[tuple[int, str], int] = {}

    def sample(self) -> None:
        for name, backend in self.backends():
            rs = getattr(backend, "replicas", None)
            if rs is None or not hasattr(rs, "load"):
                continue
            now = rs.clock()
            poller = getattr(backend, "poller", None)
            for r in rs.replicas:
                self.load.labels(name, r.api_base).set(rs.load(r, now))
                self.known.labels(name, r.api_base).set(1.0 if rs.known(r, now) else 0.0)
                if poller is not None:
                    failed, seen = poller.failed.get(r.api_base, 0), self.counted.get((id(poller), r.api_base), 0)
                    if failed > seen:
                        self.failed.labels(name, r.api_base).inc(failed - seen)
                        self.counted[(id(poller), r.api_base)] = failed


class _BudgetSampler:
    """The budget's gauges, one series per worker (each worker holds its own window); made at the
    first sample that finds a budget, so a policy without one shows none."""

    def __init__(self, budget: Callable[[], Any], registry: CollectorRegistry) -> None:
        self.budget = budget
        self.registry = registry
        self.gauges: dict[str, Gauge] = {}

    def sample(self) -> None:
        b = self.budget()
        if b is None:
            return
        for (name, doc), value in ((_OFFSET, b.offset), (_TARGET, b.target), (_SHARE, b.share)):
            if value is None:
                continue
            if name not in self.gauges:
                self.gauges[name] = Gauge(name, doc, registry=self.registry, multiprocess_mode="liveall")
            self.gauges[name].set(value)


class _QualitySampler:
    """The quality watch's counts as counters (counted up by what the watch saw since the last
    sample, as the engines' restarts are) and its estimates as gauges, one series per worker."""

    def __init__(self, watch: Callable[[], Any], registry: CollectorRegistry) -> None:
        self.watch = watch
        self.shadow = Counter("triage_shadow", "Shadow checks by result", ["model", "result"], registry=registry)
        self.cost = Counter("triage_shadow_cost", "What shadow checks cost the operator", ["model"], registry=registry)
        self.feedback = Counter("triage_feedback", "Feedback accepted, by verdict", ["verdict"], registry=registry)
        labels = ["model", "slice", "bound"]
        self.of_top = Gauge(
            "triage_quality_of_top",
            "Estimated share of the top tier's answers kept (bound: estimate, low, high)",
            labels,
            registry=registry,
            multiprocess_mode="liveall",
        )
        self.drift = Gauge(
            "triage_quality_drift",
            "1 while a model's (or slice's) estimate is under the policy's target",
            ["model", "slice"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.rolled_back = Gauge(
            "triage_rollout_rolled_back",
            "1 while a split's candidate is rolled back to its primary by the split's guard",
            ["split", "target"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.mirror_latency = Gauge(
            "triage_mirror_latency_seconds",
            "A mirror's candidate calls: latency over its last calls (quantile: 0.5, 0.95)",
            ["model", "quantile"],
            registry=registry,
            multiprocess_mode="liveall",
        )
        self.seen: dict[tuple[str, ...], float] = {}
        self.flagged: set[tuple[str, str]] = set()
        self.rolled: set[tuple[str, str]] = set()

    def _up(self, counter: Counter, labels: tuple[str, ...], total: float) -> None:
        key = (str(id(counter)), *labels)
        if total > self.seen.get(key, 0.0):
            counter.labels(*labels).inc(total - self.seen.get(key, 0.0))
            self.seen[key] = total

    def sample(self) -> None:
        w = self.watch()
        if w is None:
            return
        for (model, result), n in list(w.results.items()):
            self._up(self.shadow, (model, result), n)
        for model, cost in list(w.shadow_cost.items()):
            self._up(self.cost, (model,), cost)
        for verdict, n in list(w.feedback_given.items()):
            self._up(self.feedback, (verdict,), n)
        for e in w.estimates:
            if e.of_top is not None:
                for bound, value in (
                    ("estimate", e.of_top),
                    ("low", e.of_top_interval[0]),
                    ("high", e.of_top_interval[1]),
                ):
                    self.of_top.labels(e.model, e.slice, bound).set(value)
        _flags(self.drift, self.flagged, {(d.model, d.slice) for d in w.drift})
        _flags(self.rolled_back, self.rolled, {(str(r["split"]), str(r["target"])) for r in w.guard.report()})
        for model, seen in w.latency_report().items():
            self.mirror_latency.labels(model, "0.5").set(seen["p50_ms"] / 1000)
            self.mirror_latency.labels(model, "0.95").set(seen["p95_ms"] / 1000)


class _GuardrailSampler:
    """The guardrails' counts as counters, counted up by what the tally saw since the last sample
    (the tally is kept across reloads, so its counts only grow)."""

    def __init__(self, guardrails: Callable[[], Any], registry: CollectorRegistry) -> None:
        self.guardrails = guardrails
        self.hits = Counter(
            "triage_guardrail_hits",
            "Guardrail hits by guardrail and action",
            ["guardrail", "action"],
            registry=registry,
        )
        self.errors = Counter(
            "triage_guardrail_errors",
            "Guardrail checks that failed or passed their deadline, by guardrail and on_error",
            ["guardrail", "on_error"],
            registry=registry,
        )
        self.seen: dict[tuple[str, str, str], float] = {}

    def sample(self) -> None:
        g = self.guardrails()
        if g is None:
            return
        for counter, name, counts in ((self.hits, "hits", g.tally.hits), (self.errors, "errors", g.tally.errors)):
            for (guardrail, what), n in list(counts.items()):
                before = self.seen.get((name, guardrail, what), 0.0)
                if n > before:
                    counter.labels(guardrail, what).inc(n - before)
                    self.seen[(name, guardrail, what)] = n


def _flags(gauge: Gauge, seen: set[tuple[str, str]], now: set[tuple[str, str]]) -> None:
    """A 0/1 gauge per label pair: 1 for those in ``now``, 0 for those seen before and gone
    (``seen`` grows by ``now``)."""
    for labels in seen | now:
        gauge.labels(*labels).set(1.0 if labels in now else 0.0)
    seen |= now


class _MemorySampler:
    """The memory's size as a gauge (the largest ring of the live workers), and its feed's counts as
    a counter, counted up by what the feed did since the last sample (a reload that opens a new
    feed starts its counts again from 0)."""

    OUTCOMES = ("written", "read", "skipped", "failed", "sync_failed", "dropped")

    def __init__(self, memory: Callable[[], tuple[Any, Any]], registry: CollectorRegistry) -> None:
        self.memory = memory
        self.questions = Gauge(
            "triage_cascade_memory_questions",
            "Questions the cascade's memory of escalations holds (this gateway's ring)",
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.shared = Counter(
            "triage_cascade_memory_shared",
            "Entries of the fleet's shared memory by outcome: written by this gateway, read from the others, "
            "skipped (no fit), failed (a write to Redis), sync_failed (a read), dropped (buffer full)",
            ["outcome"],
            registry=registry,
        )
        self.feed: Any = None  # the feed last sampled
        self.seen: dict[str, float] = {}

    def sample(self) -> None:
        ring, feed = self.memory()
        self.questions.set(0 if ring is None else len(ring))
        if feed is None:
            return
        if feed is not self.feed:
            self.feed, self.seen = feed, {}
        for outcome in self.OUTCOMES:
            n = float(getattr(feed, outcome))
            if n > self.seen.get(outcome, 0.0):
                self.shared.labels(outcome).inc(n - self.seen.get(outcome, 0.0))
                self.seen[outcome] = n
