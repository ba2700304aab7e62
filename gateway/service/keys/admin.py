"""Keys made, listed, revoked and rotated, and spend read: what the admin API (``/admin``) and the
console (``/console/keys``) both do, one code path. Keys made here live in the state store, so
every gateway sharing it (Redis) knows them; the secret is returned once, at creation, and only its
sha256 is kept. Errors are raised from the error tree; the HTTP edge shapes them.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

import structlog

from gateway.service.keys import keyring
from gateway.service.runtime import Runtime
from policies import spend
from policies.errors import Conflict, InvalidRequest, NotFound
from policies.plans import public_models
from policies.schema import KeyLimits

log = structlog.get_logger("triage.admin")


def _new_secret() -> tuple[str, str]:
    key = "sk-triage-" + secrets.token_urlsafe(32)
    return key, hashlib.sha256(key.encode()).hexdigest()


def _check_name_free(rt: Runtime, name: str) -> None:
    if any(k.name == name for k in rt.policy.keys):
        raise Conflict(f"'{name}' is a key of the policy: change it in the policy file", param="name")


async def create(rt: Runtime, name: str, models: list[str] | None, limits: KeyLimits) -> dict[str, Any]:
    """A new key: its secret (shown this once), sha256, models and limits."""
    _check_name_free(rt, name)
    unknown = sorted(set(models or ()) - set(public_models(rt.policy)))
    if unknown:
        raise InvalidRequest(f"no model named {', '.join(unknown)} in the policy", param="models")
    secret, digest = _new_secret()
    now = time.time()
    if not await rt.store.key_create(name, digest, keyring.record(name, digest, models, limits, now)):
        raise Conflict(f"the key '{name}' exists: revoke or rotate it", param="name")
    log.info("key_created", key=name)
    body = {"object": "api_key", "name": name, "key": secret, "sha256": digest, "created_at": round(now, 3)}
    return {**body, "models": models, "limits": limits.model_dump(exclude_none=True)}


async def rows(rt: Runtime) -> list[dict[str, Any]]:
    """Every key, the policy's and those made here (revoked ones too), by name: never a secret."""
    now = time.time()
    out: list[dict[str, Any]] = []
    for digest, key in rt.keyring.policy_keys.items() if rt.keyring is not None else ():
        out.append(_row(key.name, digest, "policy", key.models, key.limits, None, None, now))
    for raw, revoked_at in await rt.store.key_all():
        key, doc = keyring.as_key(raw)
        out.append(_row(key.name, key.sha256, "admin", key.models, key.limits, doc["created_at"], revoked_at, now))
    out.sort(key=lambda r: (r["name"], r["created_at"] or 0))
    return out


def _row(
    name: str,
    digest: str,
    source: str,
    models: list[str] | None,
    limits: KeyLimits,
    created_at: float | None,
    revoked_at: float | None,
    now: float,
) -> dict[str, Any]:
    return {
        "object": "api_key",
        "name": name,
        "sha256_prefix": digest[:12],
        "source": source,
        "models": models,
        "limits": limits.model_dump(exclude_none=True),
        "created_at": created_at,
        "revoked_at": revoked_at,
        "active": revoked_at is None or revoked_at > now,
    }


async def revoke(rt: Runtime, name: str) -> dict[str, Any]:
    _check_name_free(rt, name)
    now = time.time()
    old = await rt.store.key_revoke(name, now)
    if old is None:
        raise NotFound(f"no live key named '{name}'", param="name")
    if rt.keyring is not None:
        rt.keyring.forget(old)
    log.info("key_revoked", key=name)
    return {"object": "api_key", "name": name, "revoked": True, "revoked_at": round(now, 3)}


async def rotate(rt: Runtime, name: str, grace_s: float) -> dict[str, Any]:
    """A new secret for a live key (shown this once); the old one works ``grace_s`` more seconds."""
    _check_name_free(rt, name)
    live = [key for raw, at in await rt.store.key_all() if at is None and (key := keyring.as_key(raw)[0]).name == name]
    if not live:
        raise NotFound(f"no live key named '{name}'", param="name")
    old = live[0]
    secret, digest = _new_secret()
    now = time.time()
    revoke_at = now + grace_s
    kept = keyring.record(name, digest, old.models, old.limits, now)
    if await rt.store.key_rotate(name, digest, kept, revoke_at) is None:
        raise NotFound(f"no live key named '{name}' (revoked meanwhile)", param="name")
    if rt.keyring is not None:
        rt.keyring.forget(old.sha256)
    log.info("key_rotated", key=name, grace_s=grace_s)
    body = {"object": "api_key", "name": name, "key": secret, "sha256": digest, "created_at": round(now, 3)}
    limits = old.limits.model_dump(exclude_none=True)
    return {**body, "models": old.models, "limits": limits, "previous_revoked_at": round(revoke_at, 3)}


async def spend_report(rt: Runtime, key: str | None, first: str | None, last: str | None) -> dict[str, Any]:
    """Spend per key, UTC day and model: one key or every key; ``first`` and ``last`` (``YYYY-MM-DD``;
    default: this month up to today)."""
    today = spend.day(time.time())
    first, last = first or today[:8] + "01", last or today
    try:
        days = spend.days_between(first, last)
    except ValueError as exc:
        raise InvalidRequest(f"from/to: {exc}", param="from") from None
    names = [key] if key else await _key_names(rt)
    keys, total = [], 0.0
    for name in names:
        by_day = await rt.store.spend(name, days)
        costs = [(d, m, c) for d in days for m, c in sorted(by_day.get(d, {}).items())]
        day_rows = [{"day": d, "model": m, "cost": round(c, 8)} for d, m, c in costs]
        keys.append({"key": name, "total": round(sum(c for *_, c in costs), 8), "days": day_rows})
        total += sum(c for *_, c in costs)
    return {"object": "spend", "from": first, "to": last, "total": round(total, 8), "keys": keys}


async def _key_names(rt: Runtime) -> list[str]:
    names = {k.name for k in rt.policy.keys}
    names.update(keyring.as_key(raw)[0].name for raw, _ in await rt.store.key_all())
    return sorted(names)
