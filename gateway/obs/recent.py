"""The console's memory: the last requests this process answered, kept whole in a ring.

Each answered request (``gateway.http.exchange``) leaves one :class:`Seen`: the objects the exchange
already holds (its decision, its route, its attempts), by reference, so keeping it costs one small
object and a dict entry. The console's pages read the ring: traffic over the last minute (requests
per second, latency percentiles, errors, by surface and model), what answered (tiers, escalations,
the router's choices, cost against always-top) and one request's trace by its id.

Per process: under ``triage serve --workers N`` each worker keeps its own ring, and a page shows the
worker that answered it (``/metrics`` is the fleet-wide view). Prompts and answers are kept only
where the policy logs prompts (``show``, fixed when the request is seen).
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from backends.base import Attempt
from policies.cascade import Decision
from policies.semantic import Route

WINDOW_S = 60.0  # the traffic page's window


@dataclass(slots=True)
class Seen:
    """One answered request."""

    request_id: str
    at: float  # unix seconds, when it finished
    surface: str  # the endpoint: chat, completions, responses, messages, decide, embeddings...
    model: str | None  # the model the request named
    served: str | None  # what answered: a model, a backend's model, a cascade tier
    status: int
    latency_ms: float
    stream: bool = False
    key: str | None = None  # the key's name, never the key
    cost: float | None = None
    always_top: float | None = None  # what always asking the top would have cost (None: no top to compare)
    usage: Mapping[str, Any] | None = None
    error: str | None = None  # the error's type
    decision: Decision | None = None
    route: Route | None = None
    attempts: list[Attempt] = field(default_factory=list)
    prompt: Any = None  # only where prompts are logged
    show: bool = False  # prompts and answers may be shown

    def trace(self) -> dict[str, Any]:
        """The request whole, as the console's trace page shows it (answers only where ``show``)."""
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "at": self.at,
            "surface": self.surface,
            "model": self.model,
            "served": self.served,
            "status": self.status,
            "latency_ms": round(self.latency_ms, 3),
            "stream": self.stream,
            "key": self.key,
            "cost": self.cost,
            "always_top": self.always_top,
            "usage": dict(self.usage) if self.usage else None,
            "error": self.error,
            "attempts": [
                {"backend": a.backend, "replica": a.replica, "outcome": a.outcome, "ms": round(a.latency_s * 1000, 3)}
                for a in self.attempts
            ],
        }
        if self.decision is not None:
            d = self.decision
            out["decision"] = {
                "tier": d.tier,
                "type": d.qtype,
                "confidence": round(d.confidence, 6),
                "cached": d.cached,
                "answer": d.answer if self.show else None,
                "steps": [{**s.as_dict(), **({} if self.show else {"answer": None})} for s in d.trace],
            }
        if self.route is not None:
            out["route"] = _route(self.route)
        if self.show and self.prompt is not None:
            out["prompt"] = self.prompt
        return out


def _route(route: Route) -> dict[str, Any]:
    out = {k: v for k, v in asdict(route).items() if k not in ("quality", "rule", "skipped")}
    out["skipped"] = [{"model": m, "why": why} for m, why in route.skipped]
    if route.rule is not None:
        out["rule"] = asdict(route.rule)
    q = route.quality
    if q is not None:
        out["candidates"] = [
            {"candidate": label, "p_right": round(p, 4), "cost": c, "chosen": i == q.candidate}
            for i, (label, p, c) in enumerate(q.predictions)
        ]
        if q.probe is not None:
            out["probe"] = {"outcome": q.probe, "ms": None if q.probe_ms is None else round(q.probe_ms, 1)}
    return out


class Recent:
    """The last ``size`` requests, oldest first, and each findable by id."""

    def __init__(self, size: int = 2000, now: Callable[[], float] = time.time) -> None:
        self.size = size
        self.now = now
        self._by_id: OrderedDict[str, Seen] = OrderedDict()
        self.total = 0  # requests seen since start

    def add(self, seen: Seen) -> None:
        self.total += 1
        by_id = self._by_id
        by_id.pop(seen.request_id, None)  # an id a client sent twice: the last one is kept
        by_id[seen.request_id] = seen
        if len(by_id) > self.size:
            by_id.popitem(last=False)

    def find(self, request_id: str) -> Seen | None:
        return self._by_id.get(request_id)

    def latest(self, n: int) -> list[Seen]:
        """The ``n`` latest, newest first."""
        out: list[Seen] = []
        for seen in reversed(self._by_id.values()):
            if len(out) >= n:
                break
            out.append(seen)
        return out

    def since(self, t: float) -> list[Seen]:
        """Those that finished after ``t``, oldest first."""
        out: list[Seen] = []
        for seen in reversed(self._by_id.values()):
            if seen.at <= t:
                break
            out.append(seen)
        out.reverse()
        return out

    def all(self) -> list[Seen]:
        return list(self._by_id.values())


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by the nearest rank; None for no values."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def _latency(rows: Iterable[Seen]) -> dict[str, float | None]:
    values = sorted(s.latency_ms for s in rows)
    return {f"p{int(q * 100)}": _r(percentile(values, q)) for q in (0.5, 0.95, 0.99)}


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def traffic(recent: Recent, window_s: float = WINDOW_S) -> dict[str, Any]:
    """The last ``window_s`` seconds: in all and per (surface, model): requests, requests per
    second, errors (4xx and 5xx), latency percentiles; requests and errors per second over the window
    (oldest first); the latest requests."""
    now = recent.now()
    rows = recent.since(now - window_s)
    groups: dict[tuple[str, str], list[Seen]] = defaultdict(list)
    for s in rows:
        groups[(s.surface, s.model or "-")].append(s)

    def line(group: list[Seen]) -> dict[str, Any]:
        return {
            "requests": len(group),
            "rps": round(len(group) / window_s, 3),
            "client_errors": sum(1 for s in group if 400 <= s.status < 500),
            "server_errors": sum(1 for s in group if s.status >= 500),
            **_latency(group),
        }

    seconds = int(window_s)
    per_second = [0] * seconds
    errors_per_second = [0] * seconds
    for s in rows:
        i = seconds - 1 - min(seconds - 1, int(now - s.at))
        per_second[i] += 1
        errors_per_second[i] += s.status >= 400
    return {
        "window_s": window_s,
        "at": now,
        "total_seen": recent.total,
        "all": line(rows),
        "by": [{"surface": k[0], "model": k[1], **line(g)} for k, g in sorted(groups.items())],
        "per_second": per_second,
        "errors_per_second": errors_per_second,
        "latest": [_brief(s) for s in recent.latest(20)],
    }


def _brief(s: Seen) -> dict[str, Any]:
    return {
        "request_id": s.request_id,
        "at": s.at,
        "surface": s.surface,
        "model": s.model,
        "served": s.served,
        "status": s.status,
        "latency_ms": round(s.latency_ms, 3),
        "cost": s.cost,
    }


def decisions(recent: Recent) -> dict[str, Any]:
    """What answered the requests in the ring: per question type the share each tier answered,
    escalations per tier and why, the routers' choices and reasons, and cost per model asked
    against always asking its top."""
    rows = recent.all()
    tiers: dict[str, Counter[str]] = defaultdict(Counter)
    why: dict[str, Counter[str]] = defaultdict(Counter)
    for s in rows:
        d = s.decision
        if d is None:
            continue
        tiers[d.qtype][d.tier] += 1
        for step in d.trace:
            if step.outcome != "accepted":
                why[step.tier][_why(step.outcome, step.confidence, step.threshold, step.error)] += 1
    routes: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
    for s in rows:
        if s.route is not None and s.model is not None:
            routes[s.model][(s.route.model, s.route.reason)] += 1
    costs: dict[str, list[Seen]] = defaultdict(list)
    for s in rows:
        if s.status < 400:
            costs[s.model or ("cascade (/v1/decide)" if s.decision is not None else "-")].append(s)
    return {
        "requests": len(rows),
        "tiers": [
            {
                "type": qtype,
                "answered": sum(c.values()),
                "by_tier": [{"tier": t, "n": n, "share": round(n / sum(c.values()), 4)} for t, n in c.most_common()],
            }
            for qtype, c in sorted(tiers.items())
        ],
        "escalations": [
            {"tier": tier, "n": sum(c.values()), "why": [{"reason": r, "n": n} for r, n in c.most_common()]}
            for tier, c in sorted(why.items())
        ],
        "routes": [
            {
                "model": model,
                "n": sum(c.values()),
                "chosen": [{"served": m, "reason": r, "n": n} for (m, r), n in c.most_common()],
            }
            for model, c in sorted(routes.items())
        ],
        "costs": [_cost_line(model, group) for model, group in sorted(costs.items())],
    }


def _why(outcome: str, confidence: float | None, threshold: float | None, error: str | None) -> str:
    if outcome == "escalated" and confidence is not None and threshold is not None:
        return "below its threshold"
    if outcome in ("failed", "exhausted") and error:
        return f"{outcome}: {error.split(':', 1)[0]}"
    return outcome


def _cost_line(model: str, group: list[Seen]) -> dict[str, Any]:
    cost = sum(s.cost or 0.0 for s in group)
    compared = [s for s in group if s.always_top is not None]
    top = sum(s.always_top or 0.0 for s in compared)
    mine = sum(s.cost or 0.0 for s in compared)
    return {
        "model": model,
        "requests": len(group),
        "cost": round(cost, 8),
        "per_request": round(cost / len(group), 8) if group else None,
        "compared": len(compared),
        "always_top": round(top, 8) if compared else None,
        "saved": round(top - mine, 8) if compared else None,
    }
