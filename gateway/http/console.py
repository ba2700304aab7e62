"""The operator's console, ``/console``: pages rendered on the server (Jinja2, autoescaped) with one
small script for the live parts, shipped in the wheel (``gateway/http/console/``): no CDN, no build.

Behind the admin key (``access.admin_key``; 404 while it is unset or ``console.enabled`` is off):
a login form sets a signed session cookie (``console_auth``). Without a session a page redirects to
the login and ``/console/api/*`` answers 401 in the API's error shape. Every write needs the
session's CSRF token and a same-origin ``Origin``. A key with a role logs in too, and sees and does
what the role table allows (``policies/roles.py``); the keys, teams and audit pages are
``console_tenancy``'s, on the admin API's own code.

Pages: traffic (live, polled every second), decisions (tiers, escalations, routes, cost against
always-top, the quality watch's estimates), one request's trace, keys and spend, batches, eval
reports (the policy's ``console.reports`` folder). The traffic and request pages read the fleet's
ring of recent requests where the policy's state is shared (Redis), else this process's
(``console_ring``); the decisions page and full traces read this process's (``gateway.obs.recent``).
Prompts and answers appear only where the policy logs prompts.
"""

from __future__ import annotations

import dataclasses
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

from gateway.http import console_auth, console_ring
from gateway.http.doors import gateway_state, read_body
from gateway.obs import recent
from gateway.service.keys import access
from gateway.service.runtime import Runtime
from policies.errors import Forbidden, InvalidRequest, NotFound, Unauthorized
from policies.roles import Action, decide

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
    ("teams", "/console/teams", "Teams"),
    ("audit", "/console/audit", "Audit log"),
    ("guardrails", "/console/guardrails", "Guardrails"),
    ("batches", "/console/batches", "Batches"),
    ("reports", "/console/reports", "Eval reports"),
]


def _runtime(request: Request) -> Runtime:
    """The runtime, while the console is on (404 otherwise, as for an unknown path)."""
    rt: Runtime = gateway_state(request).holder.current
    if not access.on(rt) or not rt.policy.console.enabled:
        raise NotFound("the console is off: set access.admin_key in the policy (and console.enabled)")
    return rt


def _cookie(request: Request, rt: Runtime) -> console_auth.Session | None:
    return console_auth.check(console_auth.secret(), rt.admin_digest, request.cookies.get(console_auth.COOKIE))


async def _session(request: Request, rt: Runtime) -> console_auth.Session | None:
    """The session, with whom it stands for now: None when the cookie is no session, or its key is
    revoked or has no role any more."""
    session = _cookie(request, rt)
    if session is None:
        return None
    who = await access.of_digest(rt, session.subject)
    if who is None:
        return None
    request.state.console_who = who
    return dataclasses.replace(session, who=who)


def _action(request: Request) -> Action:
    """What a console request does, as the role table names it."""
    path, write = request.url.path, request.method == "POST"
    if path.startswith("/console/keys"):
        return "keys.write" if write else "keys.read"
    if path.startswith("/console/teams"):
        return "teams.write" if write else "teams.read"
    if path.startswith("/console/audit"):
        return "audit.read"
    return "traffic.read"


class _Login(Exception):
    """No session on a page: the login, then back here."""


async def _page_session(request: Request) -> tuple[Runtime, console_auth.Session]:
    rt = _runtime(request)
    session = await _session(request, rt)
    if session is None:
        raise _Login()
    return rt, session


def _render(template: str, request: Request, status: int = 200, **context: Any) -> HTMLResponse:
    who = getattr(request.state, "console_who", None)
    pages = [p for p in PAGES if who is None or decide(who, _PAGE_ACTIONS.get(p[0], "traffic.read")).allowed]
    body = _ENV.get_template(template).render(pages=pages, path=request.url.path, who=who, **context)
    return HTMLResponse(body, status_code=status, headers=_HEADERS)


_PAGE_ACTIONS: dict[str, Action] = {"keys": "keys.read", "teams": "teams.read", "audit": "audit.read"}


def _login_redirect(request: Request) -> Response:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/console/login?next={quote(target, safe='')}", status_code=303, headers=_HEADERS)


def page(handler: Any) -> Any:
    """A page behind the session: without one, the login (303) instead."""

    async def route(request: Request, **kwargs: Any) -> Response:
        try:
            rt, session = await _page_session(request)
        except _Login:
            return _login_redirect(request)
        assert session.who is not None
        verdict = decide(session.who, action := _action(request))
        if not verdict.allowed:
            log.warning("console_refused", who=session.who.name, role=session.who.role, path=request.url.path)
            if request.method == "POST":  # a write refused: in the audit log, as the admin API's are
                client = request.client.host if request.client else None
                where = access.Where(client, request.headers.get("user-agent"), "console")
                await access.record(rt, session.who, action, where, request.url.path, 403, verdict.reason)
            csrf = session.csrf(console_auth.secret())
            return _render("forbidden.html", request, status=403, csrf=csrf, reason=verdict.reason)
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
    sent = hashlib.sha256(fields.get("key", "").strip().encode()).hexdigest()
    target = _safe_next(fields.get("next"))
    client = request.client.host if request.client else None
    who = await access.of_digest(rt, sent)  # the admin key, or a live key with a role
    if who is None:
        log.warning("console_login_failed", client=client)
        error = "That is not the admin key. Nor is it a live key with a role."
        return _render("login.html", request, status=401, next=target, error=error)
    ttl = rt.policy.console.session_s
    admin = rt.admin_digest is not None and hmac.compare_digest(sent, rt.admin_digest)
    value, _ = console_auth.issue(console_auth.secret(), sent, ttl, carried=not admin)
    where = access.Where(client, request.headers.get("user-agent"), "console")
    await access.record(rt, who, "console.login", where, "console", 303)
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
    await _form(request, rt, _cookie(request, rt))
    response = RedirectResponse("/console/login", status_code=303, headers=_HEADERS)
    response.delete_cookie(console_auth.COOKIE, path="/console", httponly=True, samesite="strict")
    return response


# -- pages ----------------------------------------------------------------------------------------


@router.get("")
@page
async def traffic_page(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    t = await console_ring.traffic(rt, gateway_state(request).metrics.recent)
    return _render("traffic.html", request, csrf=session.csrf(console_auth.secret()), t=t)


@router.get("/api/traffic")
async def traffic_api(request: Request) -> Response:
    """The traffic page's numbers, polled by its script: 401 without a session."""
    rt = _runtime(request)
    session = await _session(request, rt)
    if session is None or session.who is None:
        raise Unauthorized("no console session: log in at /console/login")
    if not (verdict := decide(session.who, "traffic.read")).allowed:
        raise access.denied(verdict.reason)
    body = orjson.dumps(await console_ring.traffic(rt, gateway_state(request).metrics.recent))
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
    rows, fleet = await console_ring.latest(rt, gateway_state(request).metrics.recent, 50)
    csrf = session.csrf(console_auth.secret())
    return _render("requests.html", request, csrf=csrf, latest=[s.trace() for s in rows], fleet=fleet)


@router.get("/requests/{request_id:path}")
@page
async def request_page(request: Request, rt: Runtime, session: console_auth.Session, request_id: str) -> Response:
    ring = gateway_state(request).metrics.recent
    key = request.query_params.get("key")
    seen = ring.find(request_id, key)  # ids are the client's: one per key
    csrf = session.csrf(console_auth.secret())
    if seen is None and (other := await console_ring.find(rt, request_id, key)) is not None:
        t = other.trace()  # another gateway's, or from before a restart: its summary
        return _render("trace.html", request, csrf=csrf, t=t, request_id=request_id, kept=ring.size, summary=True)
    if seen is None:
        fleet = rt.recent is not None
        return _render(
            "trace.html", request, status=404, csrf=csrf, t=None, request_id=request_id, kept=ring.size, fleet=fleet
        )
    keys = [k for k in ring.keys_of(request_id) if k != seen.key]  # other keys that sent the same id
    return _render("trace.html", request, csrf=csrf, t=seen.trace(), request_id=request_id, kept=ring.size, keys=keys)


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


@router.get("/guardrails")
@page
async def guardrails_page(request: Request, rt: Runtime, session: console_auth.Session) -> Response:
    g = rt.guardrails
    view = None
    if g is not None:
        checks = [
            {
                "name": name,
                "kind": c.type,
                "stage": c.stage,
                "action": c.action,
                "on_error": c.on_error,
                "hits": sum(n for (who, _), n in g.tally.hits.items() if who == name),
                "errors": sum(n for (who, _), n in g.tally.errors.items() if who == name),
            }
            for name, c in g.spec.checks.items()
        ]
        view = {"checks": checks, "recent": list(reversed(g.tally.recent)), "kept": g.tally.recent.maxlen}
    return _render("guardrails.html", request, csrf=session.csrf(console_auth.secret()), g=view)


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
