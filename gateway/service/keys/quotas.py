"""A key's limits and budget, checked before a request and counted after it, on the runtime's
state store (``gateway.state.stores``): across every gateway that shares it when it is Redis.

Before: the model must be one the key may ask for (403); its budget for the UTC day and month
must not be spent (429 ``insufficient_quota``); its tokens in the last minute must be under
``tpm``; then one request is counted against ``rpm`` atomically (429 ``rate_limit_exceeded``
with the seconds until a slot frees). After: the request's tokens and cost are added.

A key of a team is held to its team's limits too, in the same atomic step (the team's spend and
windows are kept under ``team:NAME``): a request is counted against both or neither. Its cost is
also added to its team's spend and, for a key of a user, to ``user:NAME``'s.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import structlog

from gateway.service.keys.teams import subject
from gateway.service.runtime import Runtime
from gateway.state.stores import Check, StoreDown
from policies import spend
from policies.errors import BudgetExhausted, Forbidden, KeyRateLimited
from policies.schema import ApiKey, KeyLimits, TeamSpec

log = structlog.get_logger("triage.quotas")
MINUTE = 60.0


async def admit(rt: Runtime, key: ApiKey | None, model: str | None, count: bool = True) -> None:
    """Raise when ``key`` (the policy's, the admin API's, or a token's caller) may not send this
    request now; else count it, against its team's limits too (``count`` False: nothing counted
    against rpm, the team's included)."""
    if key is None:
        return
    allowed(rt, key, model)
    team = await team_of(rt, key)
    subjects = [(f"the key '{key.name}'", key.name, key.limits)] if key.limits.limited else []
    if team is not None and team.limits.limited:
        assert key.team is not None
        lim = team.limits if count else team.limits.model_copy(update={"rpm": None})
        subjects.append((f"the team '{key.team}'", subject(key.team), lim))
    if not subjects:
        return
    if rt.store_problem is not None and not await recovered(rt):
        raise StoreDown(f"limits cannot be checked (fail closed): {rt.store_problem}")
    now = time.time()
    checks = tuple(_check(name, lim, now) for _, name, lim in subjects)
    refused = await rt.store.check_all(checks)
    if refused is not None:
        who, _, lim = subjects[refused[0]]
        _refuse(who, lim, refused[1], now)


def _check(name: str, lim: KeyLimits, now: float) -> Check:
    today = spend.day(now)
    days = (today, *(d for d in spend.month_days(now) if d != today)) if lim.budget_per_month is not None else (today,)
    return Check(name, days, lim.budget_per_day, lim.budget_per_month, lim.tpm, lim.rpm, MINUTE)


def _refuse(who: str, lim: KeyLimits, refusal: tuple[str, float, float], now: float) -> None:
    what, value, wait = refusal
    if what == "rpm":
        raise KeyRateLimited(f"{who} sent its {lim.rpm} requests per minute; retry in {wait:.1f} s", retry_after=wait)
    if what == "tpm":  # the wait: until the oldest tokens in the window leave it (more may be needed)
        raise KeyRateLimited(
            f"{who} used {value:.0f} of its {lim.tpm} tokens per minute; retry in {wait:.1f} s", retry_after=wait
        )
    budget = lim.budget_per_day if what == "day" else lim.budget_per_month
    assert budget is not None
    resets_at, wait = spend.resets(now, what)
    raise BudgetExhausted(
        f"{who} spent {value:.6f} of its budget of {budget:.6f} per {what}; it resets at {resets_at}",
        spent=value,
        budget=budget,
        resets_at=resets_at,
        retry_after=wait,
    )


async def team_of(rt: Runtime, key: ApiKey | None) -> TeamSpec | None:
    """The team ``key`` belongs to (None: none, or no keyring)."""
    if key is None or key.team is None or rt.keyring is None:
        return None
    return await rt.keyring.teams.get(key.team)


def allowed(rt: Runtime, key: ApiKey | None, model: str | None) -> None:
    """Forbidden (403) when ``key`` lists its models and ``model`` is not one (an unknown name is
    the route's 404; None: the door names no model)."""
    if key is None or key.models is None or model is None or model in key.models:
        return
    if model in rt.policy.models or model in rt.policy.virtual_models:
        raise Forbidden(f"the key '{key.name}' may not use the model '{model}'", param="model")


async def check_budget(rt: Runtime, key: ApiKey | None) -> None:
    """Raise BudgetExhausted when ``key``'s (or its team's) day or month budget is spent; count
    nothing (a batch's creation: its lines are charged as they run)."""
    if key is None:
        return
    team = await team_of(rt, key)
    now = time.time()
    subjects = [(f"the key '{key.name}'", key.name, key.limits)]
    if team is not None and key.team is not None:
        subjects.append((f"the team '{key.team}'", subject(key.team), team.limits))
    checks = []
    for who, name, lim in subjects:
        budgets = KeyLimits(**lim.model_dump(include={"budget_per_day", "budget_per_month"}))
        if budgets.limited:
            checks.append((who, budgets, _check(name, budgets, now)))
    if not checks:
        return
    if rt.store_problem is not None and not await recovered(rt):
        raise StoreDown(f"limits cannot be checked (fail closed): {rt.store_problem}")
    refused = await rt.store.check_all(tuple(c for *_, c in checks))
    if refused is not None:
        who, lim, _ = checks[refused[0]]
        _refuse(who, lim, refused[1], now)


async def recheck(rt: Runtime, key: ApiKey) -> None:
    """``key``'s tpm and budgets checked again while its request runs (a stream's checkpoint):
    the limit's error when one is crossed; nothing counted against ``rpm``."""
    again = key.model_copy(update={"limits": key.limits.model_copy(update={"rpm": None})})
    await admit(rt, again, None, count=False)


async def recovered(rt: Runtime, every_s: float = 1.0) -> bool:
    """A store that was down at start (degraded mode), asked again at most every ``every_s``: True
    once it answers (the gateway then counts limits again)."""
    now = time.monotonic()
    if now - rt.store_checked < every_s:
        return False
    rt.store_checked = now
    try:
        await rt.store.ping()
    except StoreDown:
        return False
    log.warning("state_store_recovered", was=rt.store_problem)
    rt.store_problem = None
    return True


async def record_owner(rt: Runtime, owner: str, charges: list[tuple[str, Mapping[str, Any] | None, float]]) -> None:
    """A batch line's cost added to the spend of the key that made the batch (``owner``: its sha256;
    budgets read it, rate windows do not: a batch is not online traffic)."""
    if rt.keyring is None or not (owed := [(m, c) for m, _, c in charges if c > 0]):
        return
    try:
        key = await rt.keyring.owner(owner)
        if key is None:
            return
        day = spend.day(time.time())
        for model, cost in owed:
            for name in spend_subjects(key):
                await rt.store.record(name, model, day, cost, 0, MINUTE)
    except StoreDown as exc:
        log.error("spend_not_recorded", owner=owner[:12], error=exc.message, batch=True)


def price(rt: Runtime, model: str | None, usage: Mapping[str, Any] | None) -> float:
    """A served call's cost at its model's prices (0 for a model without prices, or none)."""
    spec = rt.policy.models.get(model) if model is not None else None
    return spend.cost(spec.prices, usage) if spec is not None else 0.0


def spend_subjects(key: ApiKey) -> list[str]:
    """Whose spend a key's calls add to: the key's own, its team's, its user's."""
    names = [key.name]
    if key.team is not None:
        names.append(subject(key.team))
    if key.user is not None:
        names.append("user:" + key.user)
    return names


def writes(key: ApiKey | None, usage: Mapping[str, Any] | None, cost: float) -> bool:
    """Whether recording this call writes to the store (a key's spend, or its or its team's tpm window)."""
    if key is None:
        return False
    return cost > 0 or ((key.limits.tpm is not None or key.team is not None) and spend.tokens(usage) > 0)


async def record(rt: Runtime, key: ApiKey | None, model: str, usage: Mapping[str, Any] | None, cost: float) -> None:
    """Count what a served call used against ``key``: its cost in the day's spend, its tokens in the
    tpm window (one store write each for the key, its team and its user); a store that fails is
    logged, the answer being already given."""
    if key is None or not writes(key, usage, cost):
        return
    day = spend.day(time.time())
    try:
        team = await team_of(rt, key)
        for name in spend_subjects(key):
            if name == key.name:
                tpm = key.limits.tpm
            else:
                tpm = team.limits.tpm if team is not None and name == subject(key.team or "") else None
            tokens = spend.tokens(usage) if tpm is not None else 0
            if cost > 0 or tokens > 0:
                await rt.store.record(name, model, day, cost, tokens, MINUTE)
    except StoreDown as exc:  # the answer is sent: say what was not counted
        log.error("spend_not_recorded", key=key.name, model=model, cost=cost, error=exc.message)
