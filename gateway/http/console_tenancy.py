"""The console's tenancy pages: keys and spend, teams, the audit log and the role table. Behind the
console's session (``gateway.http.console``), each page and form one action of the role table
(``policies/roles.py``): a viewer sees the keys and spend and no form; a team admin sees and
changes its own team's keys only; every write is done by the admin API's own code and written to
the audit log, as the admin API's are.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse

from gateway.http import console_auth
from gateway.http.console import _HEADERS, _form, _render, page
from gateway.service.keys import access
from gateway.service.keys import admin as key_admin
from gateway.service.runtime import Runtime
from policies.errors import InvalidRequest, TriageError
from policies.roles import Action, Principal, decide, may_grant, table_rows
from policies.schema import KeyLimits, TeamSpec
from policies.schema_access import ROLES

router = APIRouter(prefix="/console")
NUMBERS = (("rpm", int), ("tpm", int), ("budget_per_day", float), ("budget_per_month", float))


def _who(session: console_auth.Session) -> Principal:
    assert session.who is not None, "page(): a session's principal is found before the page"
    return session.who


def _scope(who: Principal, action: Action) -> str | None:
    """The team a team admin acts for (None: every team)."""
    return who.team if decide(who, action).scope == "team" else None


async def _audit(request: Request, rt: Runtime, who: Principal, action: Action, target: str, status: int) -> None:
    client = request.client.host if request.client else None
    where = access.Where(client, request.headers.get("user-agent"), "console")
    await access.record(rt, who, action, where, target, status)


def _name(fields: dict[str, str], field: str = "name") -> str:
    name = fields.get(field, "").strip()
    if not name or len(name) > 64 or not all(c.isalnum() or c in "_.@-" for c in name) or not name.isascii():
        raise InvalidRequest(f"a {field} is 1 to 64 letters, digits or _ . @ -", param=field)
    return name


def _limits(fields: dict[str, str]) -> KeyLimits:
    numbers: dict[str, float | int] = {}
    for k, kind in NUMBERS:
        if v := fields.get(k, "").strip():
            numbers[k] = kind(v)
    return KeyLimits.model_validate(numbers)


def _models(fields: dict[str, str]) -> list[str] | None:
    return [m.strip() for m in fields.get("models", "").split(",") if m.strip()] or None


def _message(exc: Exception) -> tuple[str, int]:
    if isinstance(exc, TriageError):
        return exc.message, exc.status
    return f"limits: {exc}", 400


# -- keys and spend -------------------------------------------------------------------------------


@router.get("/keys")
@page
async def keys_page(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    return await _keys(request, rt, session)


async def _keys(
    request: Request,
    rt: Runtime,
    session: console_auth.Session,
    made: dict[str, Any] | None = None,
    error: str | None = None,
    status: int = 200,
) -> Response:
    who, q = _who(session), request.query_params
    scope = _scope(who, "keys.read")
    try:
        spend = await key_admin.spend_report(rt, None, q.get("from") or None, q.get("to") or None, scope=scope)
    except InvalidRequest as exc:
        spend, error = await key_admin.spend_report(rt, None, None, None, scope=scope), exc.message
        status = 400
    rows = await key_admin.rows(rt, scope)
    models = sorted(rt.policy.models) + sorted(rt.policy.virtual_models)
    csrf = session.csrf(console_auth.secret())
    writes = decide(who, "keys.write").allowed
    grants = [r for r in ROLES if may_grant(who, r)]
    context = {"keys": rows, "spend": spend, "made": made, "error": error, "models": models, "grants": grants}
    return _render("keys.html", request, status=status, csrf=csrf, writes=writes, scope=scope, **context)


@router.post("/keys")
@page
async def create_key(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    who, fields = _who(session), await _form(request, rt, session)
    target = f"key:{fields.get('name', '')[:64]}"
    try:
        name, limits = _name(fields), _limits(fields)
        team = _name(fields, "team") if fields.get("team", "").strip() else None
        user = fields.get("user", "").strip() or None
        role = fields.get("role", "").strip() or None
        if role is not None and role not in ROLES:
            raise InvalidRequest(f"no role named '{role}'", param="role")
        if not may_grant(who, role):
            raise access.denied(f"a {who.role} may not make a key with the role {role}")
        scope = _scope(who, "keys.write")
        made = await key_admin.create(rt, name, _models(fields), limits, team, user, role, scope)
    except (TriageError, ValueError) as exc:
        message, status = _message(exc)
        await _audit(request, rt, who, "keys.write", target, status)
        return await _keys(request, rt, session, error=message, status=status)
    await _audit(request, rt, who, "keys.write", target, 201)
    return await _keys(request, rt, session, made=made, status=201)


@router.post("/keys/{name}/revoke")
@page
async def revoke_key(request: Request, rt: Runtime, session: console_auth.Session, name: str) -> Response:
    who = _who(session)
    await _form(request, rt, session)
    try:
        await key_admin.revoke(rt, name, _scope(who, "keys.write"))
    except TriageError as exc:
        await _audit(request, rt, who, "keys.write", f"key:{name}", exc.status)
        return await _keys(request, rt, session, error=exc.message, status=exc.status)
    await _audit(request, rt, who, "keys.write", f"key:{name}", 200)
    return RedirectResponse("/console/keys", status_code=303, headers=_HEADERS)


@router.post("/keys/{name}/rotate")
@page
async def rotate_key(request: Request, rt: Runtime, session: console_auth.Session, name: str) -> Response:
    who, fields = _who(session), await _form(request, rt, session)
    try:
        grace = float(fields.get("grace_s") or 0)
        if not 0 <= grace <= 7 * 86400:
            raise InvalidRequest("grace_s is 0 to 604800 seconds", param="grace_s")
        made = await key_admin.rotate(rt, name, grace, _scope(who, "keys.write"))
    except (TriageError, ValueError) as exc:
        message, status = (
            (exc.message, exc.status) if isinstance(exc, TriageError) else ("grace_s must be a number", 400)
        )
        await _audit(request, rt, who, "keys.write", f"key:{name}", status)
        return await _keys(request, rt, session, error=message, status=status)
    await _audit(request, rt, who, "keys.write", f"key:{name}", 200)
    return await _keys(request, rt, session, made=made)


# -- teams ----------------------------------------------------------------------------------------


@router.get("/teams")
@page
async def teams_page(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    return await _teams(request, rt, session)


async def _teams(
    request: Request, rt: Runtime, session: console_auth.Session, error: str | None = None, status: int = 200
) -> Response:
    who = _who(session)
    assert rt.keyring is not None
    rows = await rt.keyring.teams.rows(_scope(who, "teams.read"))
    models = sorted(rt.policy.models) + sorted(rt.policy.virtual_models)
    csrf = session.csrf(console_auth.secret())
    writes = decide(who, "teams.write").allowed
    context = {"teams": rows, "models": models, "error": error, "writes": writes, "roles": table_rows()}
    return _render("teams.html", request, status=status, csrf=csrf, role_names=ROLES, **context)


@router.post("/teams")
@page
async def save_team(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    who, fields = _who(session), await _form(request, rt, session)
    target = f"team:{fields.get('name', '')[:64]}"
    assert rt.keyring is not None
    try:
        name = _name(fields)
        spec = TeamSpec(models=_models(fields), limits=_limits(fields))
        public = {*rt.policy.models, *rt.policy.virtual_models}
        await rt.keyring.teams.put(name, spec, public, new=fields.get("update") != "1")
    except (TriageError, ValueError) as exc:
        message, status = _message(exc)
        await _audit(request, rt, who, "teams.write", target, status)
        return await _teams(request, rt, session, error=message, status=status)
    await _audit(request, rt, who, "teams.write", target, 200)
    return RedirectResponse("/console/teams", status_code=303, headers=_HEADERS)


@router.post("/teams/{name}/delete")
@page
async def delete_team(request: Request, rt: Runtime, session: console_auth.Session, name: str) -> Response:
    who = _who(session)
    await _form(request, rt, session)
    assert rt.keyring is not None
    try:
        live = [r["name"] for r in await key_admin.rows(rt, team=name) if r["active"]]
        await rt.keyring.teams.delete(name, live)
    except TriageError as exc:
        await _audit(request, rt, who, "teams.write", f"team:{name}", exc.status)
        return await _teams(request, rt, session, error=exc.message, status=exc.status)
    await _audit(request, rt, who, "teams.write", f"team:{name}", 200)
    return RedirectResponse("/console/teams", status_code=303, headers=_HEADERS)


# -- the audit log --------------------------------------------------------------------------------


@router.get("/audit")
@page
async def audit_page(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    rows = await access.entries(rt, 500)
    csrf = session.csrf(console_auth.secret())
    return _render("audit.html", request, csrf=csrf, entries=rows)
