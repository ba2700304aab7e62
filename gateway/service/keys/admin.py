"""Keys made, listed, revoked and rotated, and spend read: what the admin API (``/admin``) and the
console (``/console/keys``) both do, one code path. Keys made here live in the state store, so
every gateway sharing it (Redis) knows them; the secret is returned once, at creation, and only its
sha256 is kept. Errors are raised from the error tree; the HTTP edge shapes them.

``scope``: the team a team admin acts for (None: every key); a key of another team reads as absent
to it, and is refused (403) when it names one. A key's team must exist, its models be the team's
and its limits within the team's.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

import structlog

from gateway.service.keys import keyring
from gateway.service.keys.teams import subject
from gateway.service.runtime import Runtime
from policies import spend
from policies.errors import Conflict, Forbidden, InvalidRequest, NotFound
from policies.plans import public_models
from policies.schema import ApiKey, KeyLimits, Role

log = structlog.get_logger("triage.admin")


def _new_secret() -> tuple[str, str]:
    key = "sk-triage-" + secrets.token_urlsafe(32)
    return key, hashlib.sha256(key.encode()).hexdigest()


def _check_name_free(rt: Runtime, name: str) -> None:
    if any(k.name == name for k in rt.policy.keys):
        raise Conflict(f"'{name}' is a key of the policy: change it in the policy file", param="name")


def _forbid(scope: str | None, team: str | None, what: str) -> None:
    if scope is not None and team != scope:
        raise Forbidden(f"permission denied: {what} is not of the team '{scope}'", code="permission_denied")


async def create(
    rt: Runtime,
    name: str,
    models: list[str] | None,
    limits: KeyLimits,
    team: str | None = None,
    user: str | None = None,
    role: Role | None = None,
    scope: str | None = None,
) -> dict[str, Any]:
    """A new key: its secret (shown this once), sha256, models, limits, team, user and role."""
    _check_name_free(rt, name)
    team = scope if team is None else team
    _forbid(scope, team, "the key")
    unknown = sorted(set(models or ()) - set(public_models(rt.policy)))
    if unknown:
        raise InvalidRequest(f"no model named {', '.join(unknown)} in the policy", param="models")
    await _within_team(rt, team, models, limits, role)
    secret, digest = _new_secret()
    now = time.time()
    kept = keyring.record(name, digest, models, limits, now, team=team, user=user, role=role)
    if not await rt.store.key_create(name, digest, kept):
        raise Conflict(f"the key '{name}' exists: revoke or rotate it", param="name")
    log.info("key_created", key=name, team=team, role=role)
    body = {"object": "api_key", "name": name, "key": secret, "sha256": digest, "created_at": round(now, 3)}
    tenancy = {"team": team, "user": user, "role": role}
    return {**body, "models": models, "limits": limits.model_dump(exclude_none=True), **tenancy}


async def _within_team(
    rt: Runtime, team: str | None, models: list[str] | None, limits: KeyLimits, role: Role | None
) -> None:
    """A key's team exists, and its models and limits sit within the team's."""
    if team is None:
        if role == "team_admin":
            raise InvalidRequest("a team_admin key needs a team", param="team")
        return
    found = await rt.keyring.teams.get(team) if rt.keyring is not None else None
    if found is None:
        raise InvalidRequest(f"no team named '{team}'", param="team")
    if found.models is not None and (outside := sorted(set(models or ()) - set(found.models))):
        raise InvalidRequest(f"not models of the team '{team}': {', '.join(outside)}", param="models")
    if over := limits.over(found.limits):
        raise InvalidRequest(f"over the team's limits: {'; '.join(over)}", param="limits")


async def rows(rt: Runtime, scope: str | None = None, team: str | None = None) -> list[dict[str, Any]]:
    """Every key, the policy's and those made here (revoked ones too), by name: never a secret;
    ``scope`` or ``team``: only that team's."""
    now = time.time()
    out: list[dict[str, Any]] = []
    for digest, key in rt.keyring.policy_keys.items() if rt.keyring is not None else ():
        out.append(_row(key, digest, "policy", None, None, now))
    for raw, revoked_at in await rt.store.key_all():
        key, doc = keyring.as_key(raw)
        out.append(_row(key, key.sha256, "admin", doc["created_at"], revoked_at, now))
    out = [r for r in out if scope in (None, r["team"]) and team in (None, r["team"])]
    out.sort(key=lambda r: (r["name"], r["created_at"] or 0))
    return out


def _row(
    key: ApiKey, digest: str, source: str, created_at: float | None, revoked_at: float | None, now: float
) -> dict[str, Any]:
    return {
        "object": "api_key",
        "name": key.name,
        "sha256_prefix": digest[:12],
        "source": source,
        "models": key.models,
        "limits": key.limits.model_dump(exclude_none=True),
        "team": key.team,
        "user": key.user,
        "role": key.role,
        "created_at": created_at,
        "revoked_at": revoked_at,
        "active": revoked_at is None or revoked_at > now,
    }


async def _live(rt: Runtime, name: str) -> ApiKey | None:
    """The live store key named ``name``."""
    live = [key for raw, at in await rt.store.key_all() if at is None and (key := keyring.as_key(raw)[0]).name == name]
    return live[0] if live else None


async def revoke(rt: Runtime, name: str, scope: str | None = None) -> dict[str, Any]:
    _check_name_free(rt, name)
    if scope is not None:
        live = await _live(rt, name)
        if live is None:
            raise NotFound(f"no live key named '{name}'", param="name")
        _forbid(scope, live.team, f"the key '{name}'")
    now = time.time()
    old = await rt.store.key_revoke(name, now)
    if old is None:
        raise NotFound(f"no live key named '{name}'", param="name")
    if rt.keyring is not None:
        rt.keyring.forget(old)
    log.info("key_revoked", key=name)
    return {"object": "api_key", "name": name, "revoked": True, "revoked_at": round(now, 3)}


async def rotate(rt: Runtime, name: str, grace_s: float, scope: str | None = None) -> dict[str, Any]:
    """A new secret for a live key (shown this once); the old one works ``grace_s`` more seconds."""
    _check_name_free(rt, name)
    old = await _live(rt, name)
    if old is None:
        raise NotFound(f"no live key named '{name}'", param="name")
    _forbid(scope, old.team, f"the key '{name}'")
    secret, digest = _new_secret()
    now = time.time()
    revoke_at = now + grace_s
    kept = keyring.record(name, digest, old.models, old.limits, now, team=old.team, user=old.user, role=old.role)
    if await rt.store.key_rotate(name, digest, kept, revoke_at) is None:
        raise NotFound(f"no live key named '{name}' (revoked meanwhile)", param="name")
    if rt.keyring is not None:
        rt.keyring.forget(old.sha256)
    log.info("key_rotated", key=name, grace_s=grace_s)
    body = {"object": "api_key", "name": name, "key": secret, "sha256": digest, "created_at": round(now, 3)}
    limits = old.limits.model_dump(exclude_none=True)
    tenancy = {"team": old.team, "user": old.user, "role": old.role}
    return {**body, "models": old.models, "limits": limits, **tenancy, "previous_revoked_at": round(revoke_at, 3)}


async def spend_report(
    rt: Runtime,
    key: str | None,
    first: str | None,
    last: str | None,
    team: str | None = None,
    user: str | None = None,
    scope: str | None = None,
) -> dict[str, Any]:
    """Spend per key, UTC day and model: one key, the keys of one ``team`` (with the team's own
    total: its token users' too), one ``user``'s, or every key; ``first`` and ``last``
    (``YYYY-MM-DD``; default: this month up to today). ``scope``: a team admin's team, the only
    one it may read."""
    today = spend.day(time.time())
    first, last = first or today[:8] + "01", last or today
    try:
        days = spend.days_between(first, last)
    except ValueError as exc:
        raise InvalidRequest(f"from/to: {exc}", param="from") from None
    team = scope if team is None else team
    _forbid(scope, team, "that spend")
    listed = await rows(rt, team=team)
    if key:
        if scope is not None and key not in {r["name"] for r in listed}:
            raise Forbidden(
                f"permission denied: the key '{key}' is not of the team '{scope}'", code="permission_denied"
            )
        names = [key]
    elif user:
        names = sorted({r["name"] for r in listed if r["user"] == user})
    else:
        names = sorted({r["name"] for r in listed})
    keys = [await _spent(rt, "key", name, days) for name in names]
    out: dict[str, Any] = {"object": "spend", "from": first, "to": last, "keys": keys}
    out["total"] = round(sum(k["total"] for k in keys), 8)
    if team is not None:
        out["team"] = await _spent(rt, "team", team, days, subject(team))
        out["total"] = out["team"]["total"] if not key and not user else out["total"]
    if user is not None:
        out["user"] = await _spent(rt, "user", user, days, "user:" + user)
        out["total"] = out["user"]["total"] if not key and team is None else out["total"]
    return out


async def _spent(rt: Runtime, kind: str, name: str, days: list[str], kept: str | None = None) -> dict[str, Any]:
    """One subject's spend over ``days``, per day and model (kept under ``kept``, else ``name``)."""
    by_day = await rt.store.spend(kept or name, days)
    costs = [(d, m, c) for d in days for m, c in sorted(by_day.get(d, {}).items())]
    day_rows = [{"day": d, "model": m, "cost": round(c, 8)} for d, m, c in costs]
    return {kind: name, "total": round(sum(c for *_, c in costs), 8), "days": day_rows}
