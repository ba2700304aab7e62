"""The operator's console, ``/console``: pages rendered on the server (Jinja2, autoescaped) with one
small script for the live parts, shipped in the wheel (``gateway/http/console/``): no CDN, no build.

Behind the admin key (``access.admin_key``; 404 while it is unset or ``console.enabled`` is off):
a login form sets a signed session cookie (``console_auth``). Without a session a page redirects to
the login and ``/console/api/*`` answers 401 in the API's error shape. Every write needs the
session's CSRF token and a same-origin ``Origin``. Keys are made, revoked and rotated by the admin
API's own code (``gateway.service.keys.admin``).

Pages: traffic (live, polled every second), decisions (tiers, escalations, routes, cost against
always-top, the quality watch's estimates), one request's trace, keys and spend, batches, eval
reports (the policy's ``console.reports`` folder). The request pages read this process's ring of
recent requests (``gateway.obs.recent``); prompts and answers appear only where the policy logs
prompts.
"""

from __future__ import annotations

import hashlib
import hmac
import mimetypes
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

import orjson
import structlog
from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape

from gateway.http import console_auth
from gateway.http.doors import gateway_state, read_body
from gateway.obs import recent
from gateway.service.keys import admin as key_admin
from gateway.service.runtime import Runtime
from policies.errors import Forbidden, InvalidRequest, NotFound, TriageError, Unauthorized
from policies.schema import KeyLimits

router = APIRouter(prefix="/console")
log = structlog.get_logger("triage.console")
FILES = Path(__file__).parent / "console"
MAX_FORM_BYTES = 16 * 1024
REPORT_SUFFIXES = {".json", ".png", ".svg", ".md", ".txt", ".csv", ".jsonl"}
_ENV = Environment(loader=FileSystemLoader(FILES), autoescape=select_autoescape(default=True), auto_reload=False)


def _money(x: float | None) -> str:
    return "\u2013" if x is None else f"{x:.6f}"


def _when(t: float | None) -> str:
    return "\u2013" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


_ENV.filters.update(money=_money, when=_when, strftime=lambda st: time.strftime("%Y-%m-%d %H:%M:%S", st))
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}
PAGES = [
    ("traffic", "/console", "Traffic"),
    ("decisions", "/console/decisions", "Decisions"),
    ("requests", "/console/requests", "One request"),
    ("keys", "/console/keys", "Keys and spend"),
    ("batches", "/console/batches", "Batches"),
    ("reports", "/console/reports", "Eval reports"),
]


def _runtime(request: Request) -> Runtime:
    """The runtime, while the console is on (404 otherwise, as for an unknown path)."""
    rt: Runtime = gateway_state(request).holder.current
    if rt.admin_digest is None or not rt.policy.console.enabled:
        raise NotFound("the console is off: set access.admin_key in the policy (and console.enabled)")
    return rt


def _session(request: Request, rt: Runtime) -> console_auth.Session | None:
    assert rt.admin_digest is not None
    return console_auth.check(console_auth.secret(), rt.admin_digest, request.cookies.get(console_auth.COOKIE))


class _Login(Exception):
    """No session on a page: the login, then back here."""


def _page_session(request: Request) -> tuple[Runtime, console_auth.Session]:
    rt = _runtime(request)
    session = _session(request, rt)
    if session is None:
        raise _Login()
    return rt, session


def _render(template: str, request: Request, status: int = 200, **context: Any) -> HTMLResponse:
    body = _ENV.get_template(template).render(pages=PAGES, path=request.url.path, **context)
    return HTMLResponse(body, status_code=status, headers=_HEADERS)


def _login_redirect(request: Request) -> Response:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/console/login?next={quote(target, safe='')}", status_code=303, headers=_HEADERS)


def page(handler: Any) -> Any:
    """A page behind the session: without one, the login (303) instead."""

    async def route(request: Request, **kwargs: Any) -> Response:
        try:
            rt, session = _page_session(request)
        except _Login:
            return _login_redirect(request)
        return await handler(request, rt, session, **kwargs)

    route.__name__ = handler.__name__
    route.__doc__ = handler.__doc__
    route.__signature__ = _public_signature(handler)  # type: ignore[attr-defined]
    return route


def _public_signature(handler: Any) -> Any:
    """The route's signature for FastAPI: the handler's, less the runtime and session it is given."""
    import inspect

    sig = inspect.signature(handler)
    kept = [p for name, p in sig.parameters.items() if name not in ("rt", "session")]
    return sig.replace(parameters=kept)


def _safe_next(raw: str | None) -> str:
    """Where a login goes on to: a console path of this gateway, nothing else."""
    if raw and raw.startswith("/console") and not raw.startswith("//") and "\\" not in raw:
        return raw
    return "/console"


async def _form(request: Request, rt: Runtime, session: console_auth.Session | None) -> dict[str, str]:
    """A write's form fields, once its origin (and with a session, its CSRF token) is checked."""
    h = request.headers
    if not console_auth.same_origin(h.get("origin"), h.get("referer"), h.get("host")):
        log.warning("console_cross_site_refused", path=request.url.path, origin=h.get("origin"))
        raise Forbidden("a console write must come from the console's own pages (Origin)")
    raw = await read_body(request, rt.policy.limits, MAX_FORM_BYTES)
    try:
        fields = {k: v[-1] for k, v in parse_qs(raw.decode(), keep_blank_values=True).items()}
    except UnicodeDecodeError:
        raise InvalidRequest("the form is not UTF-8") from None
    if session is not None and not hmac.compare_digest(fields.get("csrf", ""), session.csrf(console_auth.secret())):
        log.warning("console_csrf_refused", path=request.url.path)
        raise Forbidden("the form's CSRF token is missing or wrong: reload the page")
    return fields


# -- login ----------------------------------------------------------------------------------------


@router.get("/login")
async def login_form(request: Request) -> Response:
    _runtime(request)
    return _render("login.html", request, next=_safe_next(request.query_params.get("next")), error=None)


@router.post("/login")
async def login(request: Request) -> Response:
    rt = _runtime(request)
    fields = await _form(request, rt, None)
    assert rt.admin_digest is not None
    sent = hashlib.sha256(fields.get("key", "").strip().encode()).hexdigest()
    target = _safe_next(fields.get("next"))
    if not hmac.compare_digest(sent, rt.admin_digest):
        log.warning("console_login_failed", client=request.client.host if request.client else None)
        return _render("login.html", request, status=401, next=target, error="That is not the admin key.")
    ttl = rt.policy.console.session_s
    value, _ = console_auth.issue(console_auth.secret(), rt.admin_digest, ttl)
    log.info("console_login", client=request.client.host if request.client else None)
    response = RedirectResponse(target, status_code=303, headers=_HEADERS)
    response.set_cookie(
        console_auth.COOKIE,
        value,
        max_age=int(ttl),
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    rt = _runtime(request)
    await _form(request, rt, _session(request, rt))
    response = RedirectResponse("/console/login", status_code=303, headers=_HEADERS)
    response.delete_cookie(console_auth.COOKIE, path="/console", httponly=True, samesite="strict")
    return response


# -- pages ----------------------------------------------------------------------------------------


@router.get("")
@page
async def traffic_page(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    metrics = gateway_state(request).metrics
    return _render("traffic.html", request, csrf=session.csrf(console_auth.secret()), t=recent.traffic(metrics.recent))


@router.get("/api/traffic")
async def traffic_api(request: Request) -> Response:
    """The traffic page's numbers, polled by its script: 401 without a session."""
    rt = _runtime(request)
    if _session(request, rt) is None:
        raise Unauthorized("no console session: log in at /console/login")
    body = orjson.dumps(recent.traffic(gateway_state(request).metrics.recent))
    return Response(body, media_type="application/json", headers=_HEADERS)


@router.get("/decisions")
@page
async def decisions_page(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    seen = recent.decisions(gateway_state(request).metrics.recent)
    quality = await rt.watch.report() if rt.watch is not None else None
    return _render("decisions.html", request, csrf=session.csrf(console_auth.secret()), d=seen, quality=quality)


@router.get("/requests")
@page
async def find_request(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    rid = (request.query_params.get("id") or "").strip()
    if rid:
        return RedirectResponse(f"/console/requests/{quote(rid, safe='')}", status_code=303, headers=_HEADERS)
    latest = [s.trace() for s in gateway_state(request).metrics.recent.latest(50)]
    return _render("requests.html", request, csrf=session.csrf(console_auth.secret()), latest=latest)


@router.get("/requests/{request_id:path}")
@page
async def request_page(request: Request, rt: Runtime, session: console_auth.Session, request_id: str) -> Response:
    ring = gateway_state(request).metrics.recent
    seen = ring.find(request_id, request.query_params.get("key"))  # ids are the client's: one per key
    csrf = session.csrf(console_auth.secret())
    if seen is None:
        return _render("trace.html", request, status=404, csrf=csrf, t=None, request_id=request_id, kept=ring.size)
    keys = [k for k in ring.keys_of(request_id) if k != seen.key]  # other keys that sent the same id
    return _render("trace.html", request, csrf=csrf, t=seen.trace(), request_id=request_id, kept=ring.size, keys=keys)


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
    q = request.query_params
    try:
        spend = await key_admin.spend_report(rt, None, q.get("from") or None, q.get("to") or None)
    except InvalidRequest as exc:
        spend, error = await key_admin.spend_report(rt, None, None, None), exc.message
        status = 400
    rows = await key_admin.rows(rt)
    models = sorted(rt.policy.models) + sorted(rt.policy.virtual_models)
    csrf = session.csrf(console_auth.secret())
    context = {"keys": rows, "spend": spend, "made": made, "error": error, "models": models}
    return _render("keys.html", request, status=status, csrf=csrf, **context)


@router.post("/keys")
@page
async def create_key(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    fields = await _form(request, rt, session)
    name = fields.get("name", "").strip()
    models = [m.strip() for m in fields.get("models", "").split(",") if m.strip()] or None
    try:
        numbers: dict[str, float | int] = {}
        for k, kind in (("rpm", int), ("tpm", int), ("budget_per_day", float), ("budget_per_month", float)):
            if v := fields.get(k, "").strip():
                numbers[k] = kind(v)
        limits = KeyLimits.model_validate(numbers)
        if not name or len(name) > 64 or not all(c.isalnum() or c in "_.@-" for c in name) or not name.isascii():
            raise InvalidRequest("a name is 1 to 64 letters, digits or _ . @ -", param="name")
        made = await key_admin.create(rt, name, models, limits)
    except (TriageError, ValueError) as exc:
        message = exc.message if isinstance(exc, TriageError) else f"limits: {exc}"
        return await _keys(request, rt, session, error=message, status=getattr(exc, "status", 400))
    return await _keys(request, rt, session, made=made, status=201)


@router.post("/keys/{name}/revoke")
@page
async def revoke_key(request: Request, rt: Runtime, session: console_auth.Session, name: str) -> Response:
    await _form(request, rt, session)
    try:
        await key_admin.revoke(rt, name)
    except TriageError as exc:
        return await _keys(request, rt, session, error=exc.message, status=exc.status)
    return RedirectResponse("/console/keys", status_code=303, headers=_HEADERS)


@router.post("/keys/{name}/rotate")
@page
async def rotate_key(request: Request, rt: Runtime, session: console_auth.Session, name: str) -> Response:
    fields = await _form(request, rt, session)
    try:
        grace = float(fields.get("grace_s") or 0)
        if not 0 <= grace <= 7 * 86400:
            raise InvalidRequest("grace_s is 0 to 604800 seconds", param="grace_s")
        made = await key_admin.rotate(rt, name, grace)
    except (TriageError, ValueError) as exc:
        message = exc.message if isinstance(exc, TriageError) else "grace_s must be a number"
        return await _keys(request, rt, session, error=message, status=getattr(exc, "status", 400))
    return await _keys(request, rt, session, made=made)


@router.get("/batches")
@page
async def batches_page(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    runner = gateway_state(request).batches
    docs = await runner.store.batches(100, None, None) if runner is not None else []
    for doc in docs:
        if doc["status"] in ("in_progress", "finalizing", "cancelling") and runner is not None:
            doc["request_counts"] = await runner.store.counts(doc["id"])
    csrf = session.csrf(console_auth.secret())
    return _render("batches.html", request, csrf=csrf, batches=docs, available=runner is not None)


def _reports_dir(rt: Runtime) -> Path | None:
    folder = rt.policy.console.reports
    return (rt.base_dir / folder).resolve() if folder else None


@router.get("/reports")
@page
async def reports_page(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    folder = _reports_dir(rt)
    files: list[dict[str, Any]] = []
    if folder is not None and folder.is_dir():
        for p in sorted(folder.rglob("*")):
            if p.is_file() and p.suffix.lower() in REPORT_SUFFIXES and not p.is_symlink():
                st = p.stat()
                rel = p.relative_to(folder).as_posix()
                files.append({"name": rel, "bytes": st.st_size, "modified": time.gmtime(st.st_mtime)})
    csrf = session.csrf(console_auth.secret())
    return _render("reports.html", request, csrf=csrf, folder=folder, files=files)


@router.get("/reports/{name:path}")
@page
async def report_file(request: Request, rt: Runtime, session: console_auth.Session, name: str) -> Response:
    """One file of the reports folder: a JSON report shown as a page, any other served as it is."""
    folder = _reports_dir(rt)
    path = (folder / name).resolve() if folder is not None else None
    if (
        folder is None
        or path is None
        or not path.is_relative_to(folder)
        or not path.is_file()
        or path.suffix.lower() not in REPORT_SUFFIXES
    ):
        raise NotFound(f"no report named '{name}'")
    if path.suffix.lower() == ".json" and request.query_params.get("raw") is None:
        try:
            doc = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError:
            doc = None
        csrf = session.csrf(console_auth.secret())
        return _render("report.html", request, csrf=csrf, name=name, doc=doc, rows=_flat(doc))
    media = mimetypes.guess_type(path.name)[0] or "text/plain"
    if media.startswith("text/") or media == "application/json":
        media = "text/plain; charset=utf-8"  # shown, never run
    return Response(path.read_bytes(), media_type=media, headers=_HEADERS)


def _flat(doc: Any, prefix: str = "", most: int = 400) -> list[tuple[str, str]]:
    """A JSON report as (path, value) rows, for a table: at most ``most`` rows."""
    out: list[tuple[str, str]] = []

    def walk(x: Any, at: str) -> None:
        if len(out) >= most:
            return
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{at}.{k}" if at else str(k))
        elif isinstance(x, list) and x and all(isinstance(v, dict | list) for v in x):
            for i, v in enumerate(x):
                walk(v, f"{at}[{i}]")
        else:
            out.append((at, orjson.dumps(x).decode() if not isinstance(x, str) else x))

    walk(doc, prefix)
    return out


@router.get("/static/{name}")
async def static(request: Request, name: str) -> Response:
    """The console's stylesheet and script (no data in them: served without a session)."""
    _runtime(request)
    if name not in ("console.css", "console.js"):
        raise NotFound(f"no file named '{name}'")
    media = "text/css" if name.endswith(".css") else "text/javascript"
    headers = {**_HEADERS, "Cache-Control": "max-age=300"}
    return Response((FILES / name).read_bytes(), media_type=f"{media}; charset=utf-8", headers=headers)
