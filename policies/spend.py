"""What a request cost, and the calendar windows budgets are counted in. Pure: no I/O."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from policies.cascade import Decision, Step
from policies.schema import ModelSpec, Policy, Prices


def cost(prices: Prices, usage: Mapping[str, Any] | None) -> float:
    """The price of one call: its tokens at the model's prices, plus the per-call price."""
    prompt, completion = (_count(usage, k) for k in ("prompt_tokens", "completion_tokens"))
    return prices.per_call + (prompt * prices.input_per_mtok + completion * prices.output_per_mtok) / 1e6


def _count(usage: Mapping[str, Any] | None, field: str) -> int:
    value = (usage or {}).get(field)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def tokens(usage: Mapping[str, Any] | None) -> int:
    """The tokens a call used, as a key's ``tpm`` counts them."""
    return _count(usage, "total_tokens") or _count(usage, "prompt_tokens") + _count(usage, "completion_tokens")


def day(now: float) -> str:
    """The UTC day of ``now`` (a Unix time), as budgets count it: ``YYYY-MM-DD``."""
    return dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%d")


def month_days(now: float) -> list[str]:
    """Every UTC day of ``now``'s month up to its day, oldest first."""
    today = dt.datetime.fromtimestamp(now, dt.UTC).date()
    return [today.replace(day=d).isoformat() for d in range(1, today.day + 1)]


def resets(now: float, period: str) -> tuple[str, float]:
    """When a ``day`` or ``month`` budget resets: the ISO time, and the seconds until then."""
    t = dt.datetime.fromtimestamp(now, dt.UTC)
    start = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        nxt = start + dt.timedelta(days=1)
    else:
        first = start.replace(day=1)
        nxt = (first + dt.timedelta(days=32)).replace(day=1)
    return nxt.isoformat().replace("+00:00", "Z"), (nxt - t).total_seconds()


def days_between(first: str, last: str, most: int = 400) -> list[str]:
    """Every UTC day from ``first`` to ``last`` (``YYYY-MM-DD``, both included), oldest first;
    ValueError for a bad date, a reversed range or one over ``most`` days."""
    a, b = dt.date.fromisoformat(first), dt.date.fromisoformat(last)
    if b < a:
        raise ValueError(f"{last} is before {first}")
    if (b - a).days >= most:
        raise ValueError(f"at most {most} days at once")
    return [(a + dt.timedelta(days=i)).isoformat() for i in range((b - a).days + 1)]


def decision_charges(models: Mapping[str, ModelSpec], d: Decision) -> list[tuple[str, Mapping[str, int] | None, float]]:
    """What a typed decision cost: every model tier it asked (escalated and failed ones too), each
    at its model's prices; a local tier with no model in the policy is free, a cached decision too."""
    return [] if d.cached else trace_charges(models, d.trace)


def trace_charges(
    models: Mapping[str, ModelSpec], trace: Sequence[Step]
) -> list[tuple[str, Mapping[str, int] | None, float]]:
    """Each model tier of a cascade's trace at its model's prices (one that ended in a 502 too)."""
    return [
        (s.model, s.usage, cost(models[s.model].prices, s.usage))
        for s in trace
        if s.model is not None and s.model in models and s.outcome != "exhausted"  # exhausted: a repeat
    ]


def dearest(models: Mapping[str, ModelSpec], candidates: Sequence[str]) -> str:
    """A routed model's top: the candidate whose prices are the highest."""

    def dear(name: str) -> float:
        p = models[name].prices
        return p.input_per_mtok + p.output_per_mtok + p.per_call * 1e6

    return max(candidates, key=dear)


def always_top(policy: Policy, asked: str | None, d: Decision | None, usage: Mapping[str, Any] | None) -> float | None:
    """What the request would have cost had its top answered it, at the policy's prices, with the
    tokens it used: a typed decision's top is the cascade's last tier (its own charge where it was
    asked; else its prices on the prompt tokens of the model tiers asked; a local top is free), a
    routed model's the dearest candidate. None where there is no top to compare with (a model asked
    by name), or no tokens to price it by (only the encoder answered, and the top is a model)."""
    if d is not None:
        top = policy.cascade.tiers[-1] if policy.cascade is not None else None
        model = getattr(top, "model", None)
        if top is None or model is None or model not in policy.models:
            return 0.0 if top is not None else None
        asked_top = [s for s in d.trace if s.model == model and s.outcome != "exhausted"]
        if asked_top:
            return sum(cost(policy.models[model].prices, s.usage) for s in asked_top)
        prompts = [_count(s.usage, "prompt_tokens") for s in d.trace if s.usage]
        if not prompts:
            return None
        return cost(policy.models[model].prices, {"prompt_tokens": max(prompts), "completion_tokens": 1})
    vm = policy.virtual_models.get(asked or "")
    if vm is None or vm.type != "routed":
        return None
    top_model = dearest(policy.models, [c.model for c in vm.candidates])
    return cost(policy.models[top_model].prices, usage)
