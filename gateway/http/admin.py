"""The admin API under ``/admin``: keys made, listed, revoked and rotated; teams; spend; the audit
log; the quality watch's reports; a reload of the policy. Keys and teams made here live in the state
store, so every gateway sharing it (Redis) knows them; a key's secret is shown once, at creation,
and only its sha256 is kept.

Who may call: the admin key (``access.admin_key``), a key with a role, or a signed token whose
claims give one; each route is one action of the role table (``policies/roles.py``), and every call
by a principal, allowed or refused, is written to the audit log (``gateway.service.keys.access``).

Errors are raised: the app's one ``TriageError`` handler turns them into OpenAI-shaped bodies.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

import orjson
import structlog
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.http.doors import read_body
from gateway.service.bodies import parse_json
from gateway.service.keys import access
from gateway.service.keys import admin as key_admin
from gateway.service.keys.teams import Teams
from gateway.service.runtime import Runtime
from policies import quality
from policies.errors import Conflict, InvalidRequest, NotFound, TriageError
from policies.roles import ACTIONS, Action, Principal, decide, may_grant
from policies.schema import KeyLimits, Role, TeamSpec
from policies.schema_access import NAME

router = APIRouter(prefix="/admin")
MAX_BODY_BYTES = 64 * 1024  # an admin body is a key's name, models and limits: far less
log = structlog.get_logger("triage.admin")
MAX_GRACE_S = 7 * 86400


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME)
    models: list[str] | None = Field(None, description="the models and virtual models it may ask for (all: unset)")
    limits: KeyLimits = KeyLimits()
    team: str | None = Field(None, pattern=NAME, description="its team (a team admin's: its own)")
    user: str | None = Field(None, min_length=1, max_length=256, description="the person or service it stands for")
    role: Role | None = Field(None, description="its role on the admin API and the console (none: neither)")


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grace_s: float = Field(0.0, ge=0, le=MAX_GRACE_S, description="seconds the old key still works")


class TeamCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME)
    models: list[str] | None = None
    limits: KeyLimits = KeyLimits()


class TeamChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    models: list[str] | None = None
    limits: KeyLimits = KeyLimits()


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


class Act:
    """One admin action: its principal found and checked against the role table on entry, its
    outcome written to the audit log on exit. ``scope``: the team a team admin acts for."""

    def __init__(self, request: Request, action: Action, target: str = "", team: str | None = None) -> None:
        self.request, self.action, self.target, self.team = request, action, target, team
        self.rt: Runtime = request.app.state.triage.holder.current
        client = request.client.host if request.client else None
        self.where = access.Where(client, request.headers.get("user-agent"), "api")
        self.who: Principal | None = None
        self.scope: str | None = None
        self.status = 200

    async def __aenter__(self) -> Act:
        self.who = await access.principal(self.rt, self.request.headers.get("authorization"), self.where)
        verdict = await access.allow(self.rt, self.who, self.action, self.where, self.target, self.team)
        self.scope = self.who.team if verdict.scope == "team" else None
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self.who is not None
        status = exc.status if isinstance(exc, TriageError) else 500 if exc is not None else self.status
        await access.record(self.rt, self.who, self.action, self.where, self.target, status)


async def _body(request: Request, model: type[BaseModel], empty_ok: bool = False) -> Any:
    raw = await read_body(request, request.app.state.triage.holder.current.policy.limits, MAX_BODY_BYTES)
    if not raw.strip() and empty_ok:
        return model()
    try:
        return model.model_validate(parse_json(raw))
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}", param=param) from None


# -- keys -----------------------------------------------------------------------------------------


@router.post("/keys")
async def create_key(request: Request) -> Response:
    async with Act(request, "keys.write") as act:
        req: KeyCreate = await _body(request, KeyCreate)
        act.target = f"key:{req.name}"
        assert act.who is not None
        if not may_grant(act.who, req.role):
            raise access.denied(f"a {act.who.role} may not make a key with the role {req.role}")
        made = await key_admin.create(act.rt, req.name, req.models, req.limits, req.team, req.user, req.role, act.scope)
        act.status = 201
        return _json(made, 201)


@router.get("/keys")
async def list_keys(request: Request) -> Response:
    async with Act(request, "keys.read") as act:
        rows = await key_admin.rows(act.rt, act.scope, request.query_params.get("team"))
        return _json({"object": "list", "data": rows})


@router.delete("/keys/{name}")
async def revoke_key(request: Request, name: str) -> Response:
    async with Act(request, "keys.write", f"key:{name}") as act:
        return _json(await key_admin.revoke(act.rt, name, act.scope))


@router.post("/keys/{name}/rotate")
async def rotate_key(request: Request, name: str) -> Response:
    async with Act(request, "keys.write", f"key:{name}") as act:
        req: KeyRotate = await _body(request, KeyRotate, empty_ok=True)
        return _json(await key_admin.rotate(act.rt, name, req.grace_s, act.scope))


@router.get("/spend")
async def read_spend(request: Request) -> Response:
    """Spend per key, UTC day and model: ``?key=NAME``, ``?team=NAME`` (its keys, and the team's own
    total), ``?user=NAME`` (default: every key), ``from`` and ``to`` (``YYYY-MM-DD``; default: this
    month up to today)."""
    q = request.query_params
    async with Act(request, "spend.read", team=q.get("team")) as act:
        report = await key_admin.spend_report(
            act.rt, q.get("key"), q.get("from"), q.get("to"), q.get("team"), q.get("user"), act.scope
        )
        return _json(report)


# -- teams ----------------------------------------------------------------------------------------


def _public(rt: Runtime) -> set[str]:
    return {*rt.policy.models, *rt.policy.virtual_models}


def _teams(rt: Runtime) -> Teams:
    if rt.keyring is None:
        raise NotFound("no keyring: the admin API is off")
    return rt.keyring.teams


@router.get("/teams")
async def list_teams(request: Request) -> Response:
    async with Act(request, "teams.read") as act:
        return _json({"object": "list", "data": await _teams(act.rt).rows(act.scope)})


@router.post("/teams")
async def create_team(request: Request) -> Response:
    async with Act(request, "teams.write") as act:
        req: TeamCreate = await _body(request, TeamCreate)
        act.target, act.status = f"team:{req.name}", 201
        spec = TeamSpec(models=req.models, limits=req.limits)
        return _json(await _teams(act.rt).put(req.name, spec, _public(act.rt), new=True), 201)


@router.put("/teams/{name}")
async def change_team(request: Request, name: str) -> Response:
    async with Act(request, "teams.write", f"team:{name}") as act:
        req: TeamChange = await _body(request, TeamChange)
        spec = TeamSpec(models=req.models, limits=req.limits)
        return _json(await _teams(act.rt).put(name, spec, _public(act.rt), new=False))


@router.delete("/teams/{name}")
async def delete_team(request: Request, name: str) -> Response:
    async with Act(request, "teams.write", f"team:{name}") as act:
        live = [r["name"] for r in await key_admin.rows(act.rt, team=name) if r["active"]]
        return _json(await _teams(act.rt).delete(name, live))


# -- the audit log, who am I, the policy ----------------------------------------------------------


@router.get("/audit")
async def read_audit(request: Request) -> Response:
    """The newest admin actions first (``limit``, default 200, at most 10,000)."""
    async with Act(request, "audit.read") as act:
        most = int(_number(request, "limit", 200, 1, 10_000))
        return _json({"object": "list", "data": await access.entries(act.rt, most, act.scope)})


@router.get("/whoami")
async def whoami(request: Request) -> Response:
    """The caller's name, role and team, and the actions its role allows (on all, or its team's)."""
    rt: Runtime = request.app.state.triage.holder.current
    client = request.client.host if request.client else None
    who = await access.principal(rt, request.headers.get("authorization"), access.Where(client, None, "api"))
    actions = {a: v.scope for a in ACTIONS if (v := decide(who, a)).allowed}
    body = {"object": "principal", "name": who.name, "role": who.role, "team": who.team, "user": who.user}
    return _json({**body, "via": who.via, "actions": actions})


@router.post("/reload")
async def reload_policy(request: Request) -> Response:
    """Read this gateway's policy file again (as SIGHUP does): 409 when it is rejected (its problems
    are in the log) and the old policy keeps serving."""
    async with Act(request, "policy.reload", "policy") as act:
        reloader = getattr(request.app.state, "reloader", None)
        if reloader is None:
            raise NotFound("this gateway has no policy file to reload")
        if not await reloader.reload("admin_api"):
            raise Conflict("the policy file was rejected (its problems are in the log): the old policy still serves")
        return _json({"object": "reload", "applied": True, "by": act.who.name if act.who else None})


# -- quality --------------------------------------------------------------------------------------


@router.get("/quality")
async def quality_report(request: Request) -> Response:
    """The live quality estimates (policy: ``quality``): per model and question type, the share of
    the top's answers kept with its interval, agreement per tier, feedback, money saved, drift."""
    async with Act(request, "quality.read") as act:
        if act.rt.watch is None:
            raise NotFound("this policy keeps no quality records: set a `quality` section")
        return _json({"object": "quality", **await act.rt.watch.report()})


@router.get("/quality/traffic")
async def quality_traffic(request: Request) -> Response:
    """Recorded typed decisions with a label (the top's answer from a shadow check, or the kept
    answer a caller said was right) as a labeled set, one JSON row a line (``triage eval --data``);
    ``since_s`` (default: the policy's window) and ``limit`` (default 10,000)."""
    async with Act(request, "quality.read") as act:
        rt = act.rt
        if rt.watch is None:
            raise NotFound("this policy keeps no quality records: set a `quality` section")
        since_s = _number(request, "since_s", rt.watch.spec.window_s, 1.0, 10 * 365 * 86400.0)
        limit = int(_number(request, "limit", 10_000, 1, 1_000_000))
        await rt.watch.flush()
        exported = await rt.watch.store.export(time.time() - since_s, limit)
        body = b"".join(orjson.dumps(row) + b"\n" for row in quality.labeled_rows(exported))
        return Response(body, media_type="application/jsonl")


def _number(request: Request, name: str, default: float, low: float, high: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequest(f"'{name}' must be a number", param=name) from None
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be within {low:g} and {high:g}", param=name)
    return value
