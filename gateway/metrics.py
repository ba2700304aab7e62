"""Prometheus metrics, one registry per app (so several apps can live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from backends.base import Attempt

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
        self.in_flight = Gauge("triage_in_flight_requests", "Requests being served", registry=r)
        self.reloads = Counter("triage_policy_reloads", "Policy reloads", ["outcome"], registry=r)
        self.decisions = Counter(
            "triage_decisions", "Typed decisions by the tier that answered", ["tier", "type"], registry=r
        )

    def observe(
        self, endpoint: str, model: str, status: int, latency_s: float, attempts: list[Attempt], usage: dict | None
    ) -> None:
        self.requests.labels(endpoint, model, str(status)).inc()
        self.latency.labels(endpoint, model).observe(latency_s)
        for a in attempts:
            self.attempts.labels(a.backend, a.replica, a.outcome).inc()
        for kind in ("prompt", "completion"):
            count = (usage or {}).get(f"{kind}_tokens")
            if isinstance(count, int) and count >= 0:
                self.tokens.labels(model, kind).inc(count)

    def watch_backends(self, backends: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        """Gauges read at scrape time from the current backends: each admission waiting room's
        queue and its requests in flight per replica."""
        self.registry.register(_AdmissionCollector(backends))

    def watch_budget(self, budget: Callable[[], Any]) -> None:
        """Gauges read at scrape time from the current policy's escalation budget, if it has one."""
        self.registry.register(_BudgetCollector(budget))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _AdmissionCollector(Collector):
    def __init__(self, backends: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self.backends = backends

    def collect(self) -> Iterator[GaugeMetricFamily]:
        waiting = GaugeMetricFamily(
            "triage_admission_waiting", "Requests waiting for a replica slot", labels=["backend"]
        )
        busy = GaugeMetricFamily(
            "triage_admission_in_flight", "Requests holding a replica slot", labels=["backend", "replica"]
        )
        for name, backend in self.backends():
            room = getattr(backend, "admission", None)
            if room is None:
                continue
            waiting.add_metric([name], room.waiting)
            for r in room.replicas:
                busy.add_metric([name, r.state.api_base], r.in_flight)
        yield waiting
        yield busy


class _BudgetCollector(Collector):
    def __init__(self, budget: Callable[[], Any]) -> None:
        self.budget = budget

    def collect(self) -> Iterator[GaugeMetricFamily]:
        b = self.budget()
        if b is None:
            return
        yield GaugeMetricFamily(
            "triage_cascade_threshold_offset", "The escalation budget's shift of the first tiers' thresholds", b.offset
        )
        yield GaugeMetricFamily("triage_cascade_escalation_target", "The share the budget holds", b.target)
        if b.share is not None:
            yield GaugeMetricFamily(
                "triage_cascade_escalated_share", "Share of recent questions the first tier escalated", b.share
            )
