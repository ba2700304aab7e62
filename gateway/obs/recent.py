"""The console's memory: the last requests this process answered, kept whole in a ring.

Each answered request (``gateway.http.exchange``) leaves one :class:`Seen`: the objects the exchange
already holds (its decision, its route, its attempts), by reference, so keeping it costs one small
object and a dict entry. The console's pages read the ring: traffic over the last minute (requests
per second, latency percentiles, errors, by surface and model), what answered (tiers, escalations,
the router's choices, cost against always-top) and one request's trace by its id.

Per process: under ``triage serve --workers N`` each worker keeps its own ring. Where the policy's
state is shared (``state.store: redis``), each entry's :func:`summary` also goes to the fleet's ring
in Redis (``gateway/state/recent_redis.py``), which the traffic and request pages read first
(:func:`traffic_of`, :func:`from_summary`): every gateway's requests, kept across restarts; this
ring stays the fallback and holds the full traces. Prompts and answers are kept only
where the policy logs prompts (``show``, fixed when the request is seen), a prompt as its first
``console.prompt_chars`` characters.

Bounded twice: by count (``console.recent``) and by the bytes its entries hold (``console.recent_bytes``,
an estimate of each entry's strings and objects: :func:`weight`), so large bodies cannot grow it past
its bound. An entry is found by its request id and its key's name: a client that chooses its
``x-request-id`` replaces only its own key's entry of that id, never another key's.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from backends.base import Attempt
from policies.cascade import Decision
from policies.semantic import Route

WINDOW_S = 60.0  # the traffic page's window
ENTRY_BYTES = 1200  # an entry's own objects (its dataclass, dict slot, usage, an attempt or two), roughly
ATTEMPT_BYTES = 200  # each upstream try
STEP_BYTES = 400  # each step of a decision's trace
ID_CHARS = 256  # a client-chosen id, model name or error kept at most this long


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


def prefix(prompt: Any, chars: int) -> str | None:
    """A prompt as kept: its text (a message list as JSON), at most its first ``chars`` characters
    and a mark that says how much more there was."""
    if prompt is None or chars <= 0:
        return None
    text = prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
    if len(text) <= chars:
        return text
    return f"{text[:chars]}... [{len(text) - chars} more characters not kept]"


def _clip(text: str | None) -> str | None:
    return text if text is None or len(text) <= ID_CHARS else text[:ID_CHARS] + "..."


def weight(seen: Seen) -> int:
    """About the bytes an entry holds: its strings as Python keeps them, its decision's options and
    answers, its tries. An estimate (a bound against large bodies, not an exact count)."""
    size = ENTRY_BYTES + len(seen.attempts) * ATTEMPT_BYTES
    for text in (seen.request_id, seen.model, seen.served, seen.key, seen.error, seen.prompt):
        if isinstance(text, str):
            size += sys.getsizeof(text)
    d = seen.decision
    if d is not None:
        size += sys.getsizeof(d.answer) + STEP_BYTES * len(d.trace)
        size += sum(sys.getsizeof(option) + 100 for option in d.probabilities)
        size += sum(sys.getsizeof(s.answer or "") + sys.getsizeof(s.error or "") for s in d.trace)
    if seen.route is not None:
        q = seen.route.quality
        size += STEP_BYTES + (sum(sys.getsizeof(label) + 100 for label, _, _ in q.predictions) if q is not None else 0)
    return size


class Recent:
    """The last ``size`` requests (and at most ``max_bytes`` of them, by :func:`weight`), oldest
    first, each findable by its id and key."""

    def __init__(
        self,
        size: int = 2000,
        now: Callable[[], float] = time.time,
        max_bytes: int = 64 * 2**20,
        prompt_chars: int = 4096,
    ) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self.prompt_chars = prompt_chars
        self.now = now
        self._by_id: OrderedDict[tuple[str | None, str], tuple[Seen, int]] = OrderedDict()
        self.bytes = 0  # what the entries hold, by weight()
        self.total = 0  # requests seen since start

    def bound(self, size: int, max_bytes: int, prompt_chars: int) -> None:
        """The policy's bounds (``console``): they hold from the next entry on."""
        self.size, self.max_bytes, self.prompt_chars = size, max_bytes, prompt_chars

    def add(self, seen: Seen) -> None:
        """Keep ``seen``: its prompt as a bounded prefix, client-chosen strings clipped; the oldest
        entries leave while the ring is over its count or its bytes."""
        self.total += 1
        seen.request_id, seen.model, seen.error = _clip(seen.request_id) or "", _clip(seen.model), _clip(seen.error)
        seen.prompt = prefix(seen.prompt, self.prompt_chars) if seen.show else None
        by_id, at = self._by_id, (seen.key, seen.request_id)
        old = by_id.pop(at, None)  # an id a key sent twice: its last one is kept (another key's stays)
        if old is not None:
            self.bytes -= old[1]
        size = weight(seen)
        by_id[at] = (seen, size)
        self.bytes += size
        while len(by_id) > 1 and (len(by_id) > self.size or self.bytes > self.max_bytes):
            self.bytes -= by_id.popitem(last=False)[1][1]

    def find(self, request_id: str, key: str | None = None) -> Seen | None:
        """The entry with this id of the key named ``key``; without ``key``, the latest of any key."""
        if key is not None:
            found = self._by_id.get((key, request_id))
            return found[0] if found is not None else None
        return next((s for s, _ in reversed(self._by_id.values()) if s.request_id == request_id), None)

    def keys_of(self, request_id: str) -> list[str | None]:
        """The keys with an entry of this id (a client-chosen id two keys sent), newest first."""
        return [s.key for s, _ in reversed(self._by_id.values()) if s.request_id == request_id]

    def latest(self, n: int) -> list[Seen]:
        """The ``n`` latest, newest first."""
        out: list[Seen] = []
        for seen, _ in reversed(self._by_id.values()):
            if len(out) >= n:
                break
            out.append(seen)
        return out

    def since(self, t: float) -> list[Seen]:
        """Those that finished after ``t``, oldest first."""
        out: list[Seen] = []
        for seen, _ in reversed(self._by_id.values()):
            if seen.at <= t:
                break
            out.append(seen)
        out.reverse()
        return out

    def all(self) -> list[Seen]:
        return [seen for seen, _ in self._by_id.values()]


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
    """The last ``window_s`` seconds of this process's ring (:func:`traffic_of`)."""
    now = recent.now()
    return traffic_of(recent.since(now - window_s), recent.latest(20), recent.total, now, window_s)


def traffic_of(
    rows: list[Seen], latest: list[Seen], total: int, now: float, window_s: float = WINDOW_S, scope: str = "process"
) -> dict[str, Any]:
    """``rows``, those of the last ``window_s`` seconds (oldest first): in all and per (surface,
    model): requests, requests per second, errors (4xx and 5xx), latency percentiles; requests and
    errors per second over the window (oldest first); the ``latest`` requests; whose they are
    (``scope``: this ``process``'s ring, or the ``fleet``'s)."""
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
        i = seconds - 1 - min(seconds - 1, max(0, int(now - s.at)))  # another gateway's clock may run ahead
        per_second[i] += 1
        errors_per_second[i] += s.status >= 400
    return {
        "window_s": window_s,
        "at": now,
        "scope": scope,
        "total_seen": total,
        "all": line(rows),
        "by": [{"surface": k[0], "model": k[1], **line(g)} for k, g in sorted(groups.items())],
        "per_second": per_second,
        "errors_per_second": errors_per_second,
        "latest": [_brief(s) for s in latest],
    }


def _brief(s: Seen) -> dict[str, Any]:
    return {
        "request_id": s.request_id,
        "key": s.key,
        "at": s.at,
        "surface": s.surface,
        "model": s.model,
        "served": s.served,
        "status": s.status,
        "latency_ms": round(s.latency_ms, 3),
        "cost": s.cost,
    }


SUMMARY_BYTES = 800  # a summary's own fields, about, at most (its strings clipped to ID_CHARS)


def summary(seen: Seen, most_bytes: int) -> dict[str, Any]:
    """What the fleet's ring keeps of an entry (``gateway/state/recent_redis.py``): what the traffic
    and request pages show, without the decision's and route's objects; the prompt (kept only where
    prompts are logged, already a prefix) cut further to keep the summary near ``most_bytes``."""
    out = {
        **_brief(seen),
        "stream": seen.stream,
        "error": seen.error,
        "always_top": seen.always_top,
        "tier": seen.decision.tier if seen.decision is not None else None,
        "routed": seen.route.model if seen.route is not None else None,
    }
    if seen.usage:
        out["usage"] = {k: seen.usage.get(k) for k in ("prompt_tokens", "completion_tokens")}
    if seen.show and isinstance(seen.prompt, str):
        room = most_bytes - SUMMARY_BYTES
        fits = len(seen.prompt) * 4 <= room or len(seen.prompt.encode()) <= room
        out["prompt"] = seen.prompt if fits else prefix(seen.prompt, room // 4)  # UTF-8: 4 bytes a character at most
    return out


def from_summary(item: Mapping[str, Any]) -> Seen:
    """An entry of the fleet's ring as a :class:`Seen` (no decision, route or tries: the trace of
    the gateway that answered it has those), for the pages that read a ring."""

    def text(k: str) -> str | None:
        v = item.get(k)
        return v if isinstance(v, str) else None

    def number(k: str) -> float | None:
        v = item.get(k)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    served = text("served") or text("tier") or text("routed")
    usage = item.get("usage")
    prompt = text("prompt")
    return Seen(
        text("request_id") or "",
        number("at") or 0.0,
        text("surface") or "-",
        text("model"),
        served,
        int(number("status") or 0),
        number("latency_ms") or 0.0,
        bool(item.get("stream")),
        text("key"),
        number("cost"),
        number("always_top"),
        usage if isinstance(usage, dict) else None,
        text("error"),
        prompt=prompt,
        show=prompt is not None,
    )


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
