"""A key's limits and budget, checked before a request and counted after it, on the runtime's
state store (``gateway.stores``): across every gateway that shares it when it is Redis.

Before: the model must be one the key may ask for (403); its budget for the UTC day and month
must not be spent (429 ``insufficient_quota``); its tokens in the last minute must be under
``tpm``; then one request is counted against ``rpm`` atomically (429 ``rate_limit_exceeded``
with the seconds until a slot frees). After: the request's tokens and cost are added.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import structlog

from gateway.runtime import Runtime
from gateway.stores import StoreDown
from policies import spend
from policies.errors import BudgetExhausted, Forbidden, KeyRateLimited
from policies.schema import ApiKey

log = structlog.get_logger("triage.quotas")
MINUTE = 60.0


async def admit(rt: Runtime, key: ApiKey | None, model: str | None) -> None:
    """Raise when ``key`` (the policy's, or the admin API's) may not send this request now; else count it."""
    if key is None:
        return
    known = model is not None and (model in rt.policy.models or model in rt.policy.virtual_models)
    if key.models is not None and known and model not in key.models:  # an unknown name is the route's 404
        raise Forbidden(f"the key '{key.name}' may not use the model '{model}'", param="model")
    lim = key.limits
    if lim.rpm is None and lim.tpm is None and lim.budget_per_day is None and lim.budget_per_month is None:
        return
    if rt.store_problem is not None:
        raise StoreDown(f"limits cannot be checked (fail closed): {rt.store_problem}")
    now = time.time()
    if lim.budget_per_day is not None or lim.budget_per_month is not None:
        await _budget(rt, key, now)
    if lim.tpm is not None:
        used = await rt.store.used(f"tpm:{key.name}", MINUTE)
        if used >= lim.tpm:
            raise KeyRateLimited(
                f"the key '{key.name}' used {used} of its {lim.tpm} tokens per minute", retry_after=MINUTE / 4
            )
    if lim.rpm is not None:
        wait = await rt.store.admit(f"rpm:{key.name}", lim.rpm, MINUTE)
        if wait is not None:
            raise KeyRateLimited(
                f"the key '{key.name}' sent its {lim.rpm} requests per minute; retry in {wait:.1f} s", retry_after=wait
            )


async def _budget(rt: Runtime, key: ApiKey, now: float) -> None:
    lim = key.limits
    days = spend.month_days(now) if lim.budget_per_month is not None else [spend.day(now)]
    by_day = await rt.store.spend(key.name, days)
    for period, budget, spent in (
        ("day", lim.budget_per_day, sum(by_day.get(spend.day(now), {}).values())),
        ("month", lim.budget_per_month, sum(sum(m.values()) for m in by_day.values())),
    ):
        if budget is not None and spent >= budget:
            resets_at, wait = spend.resets(now, period)
            raise BudgetExhausted(
                f"the key '{key.name}' spent {spent:.6f} of its budget of {budget:.6f} per {period}; "
                f"it resets at {resets_at}",
                spent=spent,
                budget=budget,
                resets_at=resets_at,
                retry_after=wait,
            )


async def record(
    rt: Runtime, key: ApiKey | None, model: str | None, usage: Mapping[str, Any] | None, cost: float | None = None
) -> float:
    """Count what a served request used; its cost (``cost`` when the caller priced it already; 0 for a
    model without prices, or no model)."""
    if cost is None:
        spec = rt.policy.models.get(model) if model is not None else None
        cost = spend.cost(spec.prices, usage) if spec is not None else 0.0
    if key is None or model is None:
        return cost
    try:
        if key.limits.tpm is not None and (used := spend.tokens(usage)) > 0:
            await rt.store.add(f"tpm:{key.name}", used, MINUTE)
        if cost > 0:
            await rt.store.add_spend(key.name, model, spend.day(time.time()), cost)
    except StoreDown as exc:  # the answer is sent: say what was not counted
        log.error("spend_not_recorded", key=key.name, model=model, cost=cost, error=exc.message)
    return cost
