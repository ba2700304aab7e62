"""The admin API under ``/admin``, behind its own key (``access.admin_key``): keys made, listed,
revoked and rotated, and spend read. Keys made here live in the state store, so every gateway
sharing it (Redis) knows them; the secret is shown once, at creation, and only its sha256 is kept.

Errors are raised: the app's one ``TriageError`` handler turns them into OpenAI-shaped bodies.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any

import orjson
import structlog
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.http.doors import read_body
from gateway.service import keyring
from gateway.service.bodies import parse_json
from gateway.service.runtime import Runtime
from policies import quality, spend
from policies.errors import Conflict, InvalidRequest, NotFound, Unauthorized
from policies.plans import public_models
from policies.schema import KeyLimits

router = APIRouter(prefix="/admin")
MAX_BODY_BYTES = 64 * 1024  # an admin body is a key's name, models and limits: far less
log = structlog.get_logger("triage.admin")
NAME = r"^[A-Za-z0-9_.@-]{1,64}$"
MAX_GRACE_S = 7 * 86400


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME)
    models: list[str] | None = Field(None, description="the models and virtual models it may ask for (all: unset)")
    limits: KeyLimits = KeyLimits()


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grace_s: float = Field(0.0, ge=0, le=MAX_GRACE_S, description="seconds the old key still works")


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _admin(request: Request) -> Runtime:
    """The runtime, once the admin key is checked (404 while the admin API is off)."""
    rt: Runtime = request.app.state.triage.holder.current
    if rt.admin_digest is None:
        raise NotFound("the admin API is off: set access.admin_key in the policy")
    sent = rt.key_digest(request.headers.get("authorization"))
    if sent is None or not hmac.compare_digest(sent, rt.admin_digest):
        raise Unauthorized("Incorrect or missing admin key: send 'Authorization: Bearer <admin key>'")
    return rt


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


def _new_secret() -> tuple[str, str]:
    key = "sk-triage-" + secrets.token_urlsafe(32)
    return key, hashlib.sha256(key.encode()).hexdigest()


def _check_name_free(rt: Runtime, name: str) -> None:
    if any(k.name == name for k in rt.policy.keys):
        raise Conflict(f"'{name}' is a key of the policy: change it in the policy file", param="name")


@router.post("/keys")
async def create_key(request: Request) -> Response:
    rt = _admin(request)
    req: KeyCreate = await _body(request, KeyCreate)
    _check_name_free(rt, req.name)
    unknown = sorted(set(req.models or ()) - set(public_models(rt.policy)))
    if unknown:
        raise InvalidRequest(f"no model named {', '.join(unknown)} in the policy", param="models")
    secret, digest = _new_secret()
    now = time.time()
    if not await rt.store.key_create(req.name, digest, keyring.record(req.name, digest, req.models, req.limits, now)):
        raise Conflict(f"the key '{req.name}' exists: revoke or rotate it", param="name")
    log.info("key_created", key=req.name)
    body = {"object": "api_key", "name": req.name, "key": secret, "sha256": digest, "created_at": round(now, 3)}
    return _json({**body, "models": req.models, "limits": req.limits.model_dump(exclude_none=True)}, 201)


@router.get("/keys")
async def list_keys(request: Request) -> Response:
    rt = _admin(request)
    now = time.time()
    rows: list[dict[str, Any]] = []
    for digest, key in rt.keyring.policy_keys.items() if rt.keyring is not None else ():
        rows.append(_row(key.name, digest, "policy", key.models, key.limits, None, None, now))
    for raw, revoked_at in await rt.store.key_all():
        key, doc = keyring.as_key(raw)
        rows.append(_row(key.name, key.sha256, "admin", key.models, key.limits, doc["created_at"], revoked_at, now))
    rows.sort(key=lambda r: (r["name"], r["created_at"] or 0))
    return _json({"object": "list", "data": rows})


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


@router.delete("/keys/{name}")
async def revoke_key(request: Request, name: str) -> Response:
    rt = _admin(request)
    _check_name_free(rt, name)
    now = time.time()
    old = await rt.store.key_revoke(name, now)
    if old is None:
        raise NotFound(f"no live key named '{name}'", param="name")
    if rt.keyring is not None:
        rt.keyring.forget(old)
    log.info("key_revoked", key=name)
    return _json({"object": "api_key", "name": name, "revoked": True, "revoked_at": round(now, 3)})


@router.post("/keys/{name}/rotate")
async def rotate_key(request: Request, name: str) -> Response:
    rt = _admin(request)
    req: KeyRotate = await _body(request, KeyRotate, empty_ok=True)
    _check_name_free(rt, name)
    live = [key for raw, at in await rt.store.key_all() if at is None and (key := keyring.as_key(raw)[0]).name == name]
    if not live:
        raise NotFound(f"no live key named '{name}'", param="name")
    old = live[0]
    secret, digest = _new_secret()
    now = time.time()
    revoke_at = now + req.grace_s
    kept = keyring.record(name, digest, old.models, old.limits, now)
    if await rt.store.key_rotate(name, digest, kept, revoke_at) is None:
        raise NotFound(f"no live key named '{name}' (revoked meanwhile)", param="name")
    if rt.keyring is not None:
        rt.keyring.forget(old.sha256)
    log.info("key_rotated", key=name, grace_s=req.grace_s)
    body = {"object": "api_key", "name": name, "key": secret, "sha256": digest, "created_at": round(now, 3)}
    limits = old.limits.model_dump(exclude_none=True)
    return _json({**body, "models": old.models, "limits": limits, "previous_revoked_at": round(revoke_at, 3)})


@router.get("/spend")
async def read_spend(request: Request) -> Response:
    """Spend per key, UTC day and model: ``?key=NAME`` (default: every key), ``from`` and ``to``
    (``YYYY-MM-DD``; default: this month up to today)."""
    rt = _admin(request)
    q = request.query_params
    today = spend.day(time.time())
    first, last = q.get("from") or today[:8] + "01", q.get("to") or today
    try:
        days = spend.days_between(first, last)
    except ValueError as exc:
        raise InvalidRequest(f"from/to: {exc}", param="from") from None
    names = [q["key"]] if q.get("key") else await _key_names(rt)
    keys, total = [], 0.0
    for name in names:
        by_day = await rt.store.spend(name, days)
        costs = [(d, m, c) for d in days for m, c in sorted(by_day.get(d, {}).items())]
        rows = [{"day": d, "model": m, "cost": round(c, 8)} for d, m, c in costs]
        keys.append({"key": name, "total": round(sum(c for *_, c in costs), 8), "days": rows})
        total += sum(c for *_, c in costs)
    total = round(total, 8)
    return _json({"object": "spend", "from": first, "to": last, "total": total, "keys": keys})


async def _key_names(rt: Runtime) -> list[str]:
    names = {k.name for k in rt.policy.keys}
    names.update(keyring.as_key(raw)[0].name for raw, _ in await rt.store.key_all())
    return sorted(names)


@router.get("/quality")
async def quality_report(request: Request) -> Response:
    """The live quality estimates (policy: ``quality``): per model and question type, the share of
    the top's answers kept with its interval, agreement per tier, feedback, money saved, drift."""
    rt = _admin(request)
    if rt.watch is None:
        raise NotFound("this policy keeps no quality records: set a `quality` section")
    return _json({"object": "quality", **await rt.watch.report()})


@router.get("/quality/traffic")
async def quality_traffic(request: Request) -> Response:
    """Recorded typed decisions with a label (the top's answer from a shadow check, or the kept
    answer a caller said was right) as a labeled set, one JSON row a line (``triage eval --data``);
    ``since_s`` (default: the policy's window) and ``limit`` (default 10,000)."""
    rt = _admin(request)
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
