"""The admin API under ``/admin``, behind its own key (``access.admin_key``): keys made, listed,
revoked and rotated, and spend read. Keys made here live in the state store, so every gateway
sharing it (Redis) knows them; the secret is shown once, at creation, and only its sha256 is kept.

Errors are raised: the app's one ``TriageError`` handler turns them into OpenAI-shaped bodies.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

import orjson
import structlog
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.http.doors import read_body
from gateway.service.bodies import parse_json
from gateway.service.keys import admin as key_admin
from gateway.service.runtime import Runtime
from policies import quality
from policies.errors import InvalidRequest, NotFound, Unauthorized
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


@router.post("/keys")
async def create_key(request: Request) -> Response:
    rt = _admin(request)
    req: KeyCreate = await _body(request, KeyCreate)
    return _json(await key_admin.create(rt, req.name, req.models, req.limits), 201)


@router.get("/keys")
async def list_keys(request: Request) -> Response:
    return _json({"object": "list", "data": await key_admin.rows(_admin(request))})


@router.delete("/keys/{name}")
async def revoke_key(request: Request, name: str) -> Response:
    return _json(await key_admin.revoke(_admin(request), name))


@router.post("/keys/{name}/rotate")
async def rotate_key(request: Request, name: str) -> Response:
    rt = _admin(request)
    req: KeyRotate = await _body(request, KeyRotate, empty_ok=True)
    return _json(await key_admin.rotate(rt, name, req.grace_s))


@router.get("/spend")
async def read_spend(request: Request) -> Response:
    """Spend per key, UTC day and model: ``?key=NAME`` (default: every key), ``from`` and ``to``
    (``YYYY-MM-DD``; default: this month up to today)."""
    rt = _admin(request)
    q = request.query_params
    return _json(await key_admin.spend_report(rt, q.get("key"), q.get("from"), q.get("to")))


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
