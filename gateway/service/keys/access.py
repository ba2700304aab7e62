"""Who sent an admin request and whether the role table (:mod:`policies.roles`) lets them: what the
admin API and the console both ask, each answer written to the audit log (who, what, when, from
where: the fleet's store, :mod:`gateway.state.tenancy`).

A principal is the admin key's holder (role ``admin``), a key with a role, or a signed token whose
claims map to one. Anything else is a 401 (nothing of the credential is echoed); a principal whose
role may not do the action is a 403 ``permission_denied``, and both are logged. Unauthenticated
attempts go to the log only, never the audit log, so that nobody without a credential can fill it.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import time
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.service.keys.keyring import admin_api
from gateway.service.runtime import Runtime
from gateway.state.stores import StoreDown
from gateway.state.tenancy import open_tenancy
from policies.errors import Forbidden, NotFound, Unauthorized
from policies.roles import Action, Principal, Verdict, decide

log = structlog.get_logger("triage.audit")
HOST = socket.gethostname()
OFF = "the admin API is off: set access.admin_key in the policy (or give a key a role, or set access.tokens)"
NO_CREDENTIAL = (
    "Incorrect or missing admin credential: send 'Authorization: Bearer <admin key, key with a role or token>'"
)


@dataclass(frozen=True)
class Where:
    """Where an admin request came from (the audit log's "from where")."""

    client: str | None
    agent: str | None
    surface: str  # "api" (the admin API, and so `triage keys`) or "console"


def on(rt: Runtime) -> bool:
    """Whether the admin API and the console are on."""
    return rt.admin_digest is not None or (rt.keyring is not None and admin_api(rt.policy))


async def principal(rt: Runtime, authorization: str | None, where: Where) -> Principal:
    """The admin caller behind ``authorization``: the admin key, a key with a role, or a token with
    one (404 while the admin API is off; 401 for anything else)."""
    if not on(rt):
        raise NotFound(OFF)
    found = await _principal(rt, authorization)
    if found is None:
        log.warning("admin_refused", reason="no admin credential", client=where.client, surface=where.surface)
        raise Unauthorized(NO_CREDENTIAL)
    return found


async def _principal(rt: Runtime, authorization: str | None) -> Principal | None:
    if not authorization or not authorization.startswith("Bearer "):
        return None
    credential = authorization[7:].strip()
    digest = hashlib.sha256(credential.encode()).hexdigest()
    if rt.admin_digest is not None and hmac.compare_digest(digest, rt.admin_digest):
        return Principal("admin", "admin", via="admin_key")
    if rt.keyring is None:
        return None
    key = await rt.keyring.caller(authorization)
    if key is None or key.role is None:
        return None
    return Principal(key.name, key.role, key.team, key.user, via="token" if key.name.startswith("jwt:") else "key")


async def of_digest(rt: Runtime, digest: str) -> Principal | None:
    """The principal a console session stands for: the admin key's sha256, or a live key's with a role."""
    if rt.admin_digest is not None and hmac.compare_digest(digest, rt.admin_digest):
        return Principal("admin", "admin", via="admin_key")
    key = await rt.keyring.lookup(digest) if rt.keyring is not None else None
    if key is None or key.role is None:
        return None
    return Principal(key.name, key.role, key.team, key.user, via="key")


def denied(reason: str) -> Forbidden:
    """The refusal of an action the principal's role does not allow (403 ``permission_denied``)."""
    return Forbidden(f"permission denied: {reason}", code="permission_denied")


async def allow(
    rt: Runtime, who: Principal, action: Action, where: Where, target: str = "", team: str | None = None
) -> Verdict:
    """The role table's verdict; a refusal is written to the audit log and raised (403)."""
    verdict = decide(who, action, team)
    if not verdict.allowed:
        await record(rt, who, action, where, target, 403, verdict.reason)
        raise denied(verdict.reason)
    return verdict


async def record(
    rt: Runtime, who: Principal, action: Action | str, where: Where, target: str, status: int, note: str = ""
) -> None:
    """One admin action in the audit log: who, what, on what, when, from where, and its outcome."""
    entry: dict[str, Any] = {
        "at": round(time.time(), 3),
        "who": who.name,
        "role": who.role,
        "via": who.via,
        "team": who.team,
        "user": who.user,
        "action": action,
        "target": target[:200],
        "outcome": "allowed" if status < 400 else "refused" if status in (401, 403) else "failed",
        "status": status,
        "client": where.client,
        "agent": (where.agent or "")[:200] or None,
        "surface": where.surface,
        "gateway": HOST,
    }
    if note:
        entry["note"] = note[:300]
    log.info("admin_action", **{k: v for k, v in entry.items() if k != "at"})
    try:
        await open_tenancy(rt.store).audit_add(entry)
    except StoreDown as exc:
        log.error("audit_not_recorded", action=action, who=who.name, error=exc.message)


async def entries(rt: Runtime, most: int, team: str | None = None) -> list[dict[str, Any]]:
    """The newest audit entries (``team``: only those of principals of that team)."""
    rows = await open_tenancy(rt.store).audit_read(most if team is None else most * 10)
    return [r for r in rows if team is None or r.get("team") == team][:most]
