"""``create_app(settings)``: the FastAPI app. Nothing happens at import; the policy is loaded
and the backends are started in the lifespan, and stopped when the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.routing import Route as HTTPRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.batch.runner import BatchRunner
from gateway.http import admin, batch_api, console, console_tenancy
from gateway.http.api import HOT_ROUTES, router
from gateway.http.app_state import GatewayState
from gateway.http.doors import AFTER, error_response
from gateway.http.settings import Settings
from gateway.obs import logs, tracing
from gateway.obs.metrics import Metrics
from gateway.service import assemble
from gateway.service.reload import Reloader
from gateway.service.runtime import RuntimeHolder
from gateway.state.batches import StoreBusy, open_batches
from gateway.state.stores import StoreDown
from policies import loader
from policies.errors import ClientGone, InvalidRequest, NotFound, PolicyInvalid, TriageError
from policies.processes import per_process_problems
from policies.schema import Policy

log = structlog.get_logger("triage.app")


async def _batch_runner(policy: Policy, settings: Settings, holder: RuntimeHolder) -> BatchRunner | None:
    """The Batch API's store and runner: the folder is the policy's (relative to the policy file),
    else one per policy file in the triage cache; jobs left unfinished by the last run resume now.
    A SQLite store another gateway process holds leaves this one without the Batch API (503); a
    PostgreSQL one (``state.database``) that cannot be reached stops the start (PolicyInvalid)."""
    import hashlib

    from policies.paths import cache_dir

    path = settings.policy_path.resolve()
    root = (
        path.parent / policy.batches.dir
        if policy.batches.dir
        else cache_dir() / "batches" / hashlib.sha1(str(path).encode()).hexdigest()[:16]
    )
    try:
        store = await open_batches(policy.state, root.resolve())
    except StoreBusy as exc:
        log.warning("batches_unavailable", reason=str(exc))
        return None
    except StoreDown as exc:
        raise PolicyInvalid([f"state.database: {exc.message}"]) from None
    runner = BatchRunner(store, holder, base_dir=path.parent)
    runner.start()
    return runner


def create_app(settings: Settings) -> FastAPI:
    traces = tracing.Tracing()  # started with the policy: off unless an OTLP endpoint is set

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        running = await _start(app, settings, traces)
        try:
            yield
        finally:
            await running.stop()

    # /openapi.json is gateway.http.api's own route: behind the key when the policy has keys
    app = _Gateway(
        title="triage",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,  # a path that is not a route is a 404 in the API's shape, not a 307 (before any key)
        **_NO_FASTAPI_TELEMETRY,
    )
    app.router.routes.extend(HOT_ROUTES)
    app.include_router(router)
    app.include_router(batch_api.router)
    app.include_router(admin.router)
    app.include_router(console.router)
    app.include_router(console_tenancy.router)
    _error_handlers(app)
    app.add_middleware(_Edge)
    app.add_middleware(tracing.Middleware, tracing=traces)  # outside the edge: its 500s are in the span
    app.hot = _exact(HOT_ROUTES)
    app.hot_edge = tracing.Middleware(_Edge(_unreached, hot=app.hot), tracing=traces)
    return app


@dataclass
class _Running:
    """What a started gateway runs besides its routes, stopped in order when it stops."""

    holder: RuntimeHolder
    batches: Any
    reloader: Reloader
    sighup: bool
    stop_event: asyncio.Event
    tasks: list[asyncio.Task[None]]
    traces: tracing.Tracing

    async def stop(self) -> None:
        self.stop_event.set()
        try:
            for task in self.tasks:  # the metrics sampler, the policy file's watcher
                await task
        finally:
            await asyncio.to_thread(self.traces.close)  # the last spans exported, first
            if self.sighup:
                self.reloader.remove_sighup()
            if self.batches is not None:
                await self.batches.close()
            await self.holder.close()
            log.info("gateway_stopped")


async def _start(app: FastAPI, settings: Settings, traces: tracing.Tracing) -> _Running:
    """The policy loaded and its runtime assembled, the batch runner, the reloader (SIGHUP, the
    file watch), the metrics' sampler and tracing started: what the lifespan stops again."""
    policy = await asyncio.to_thread(loader.load, settings.policy_path)
    if problems := per_process_problems(policy, settings.workers):  # a worker of --workers N
        raise PolicyInvalid(problems)
    if settings.configure_logging:
        logs.configure(policy.logging)
    metrics = Metrics()
    holder = RuntimeHolder(
        await assemble.build(policy, base_dir=settings.policy_path.parent, source=settings.policy_path)
    )
    try:
        batches = await _batch_runner(policy, settings, holder)
    except BaseException:
        await holder.close()
        raise
    app.state.triage = GatewayState(holder, metrics, batches=batches)
    metrics.watch_backends(lambda: holder.current.backends.items())
    metrics.watch_budget(lambda: holder.current.budget)
    metrics.watch_quality(lambda: holder.current.watch)
    metrics.watch_guardrails(lambda: holder.current.guardrails)
    metrics.watch_memory(lambda: (holder.current.recall, holder.current.memory_feed))
    reloader = Reloader(settings.policy_path, holder, metrics, lambda p: per_process_problems(p, settings.workers))
    app.state.reloader = reloader
    sighup = settings.handle_sighup and reloader.install_sighup()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(metrics.run(stop))]  # with workers: the gauges they share
    if settings.watch_policy:
        tasks.append(asyncio.create_task(reloader.watch(stop)))
    if settings.freeze_gc:
        gc.collect()
        gc.freeze()  # start-up objects (libraries, policy, models) are never scanned again
    log.info(
        "gateway_started",
        policy=str(settings.policy_path),
        models=list(policy.models),
        backends=list(policy.backends),
        sighup=sighup,
        watch=settings.watch_policy,
    )
    await asyncio.to_thread(traces.start, policy.tracing)
    return _Running(holder, batches, reloader, sighup, stop, tasks, traces)


def _error_handlers(app: FastAPI) -> None:
    """FastAPI's and Starlette's own errors in the API's shape (the doors map triage's)."""

    @app.exception_handler(TriageError)
    async def _triage_error(request: Request, exc: TriageError) -> Response:
        if isinstance(exc, ClientGone):  # a route outside the exchange (an upload): the client's doing
            log.info("client_gone", method=request.method, path=request.url.path, status=exc.status)
            app.state.triage.metrics.errors.labels(exc.type, str(exc.status)).inc()
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(NotFound(f"No route for {request.method} {request.url.path}"), request.url.path)
        err = InvalidRequest(str(exc.detail))
        response = error_response(err, request.url.path)
        response.status_code = exc.status_code
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:  # every method the path takes (Starlette names only its first route's)
            response.headers["Allow"] = ", ".join(_allowed(request))
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(InvalidRequest(str(exc.errors()[0].get("msg", "invalid request"))), request.url.path)


def _allowed(request: Request) -> list[str]:
    """The methods some route of the app serves at this request's path, as a 405's ``Allow`` (RFC 9110):
    each method tried against the routes, which match in full only where path and method both do."""
    routes = request.app.router.routes
    return [
        method
        for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)
    ]


Endpoint = Callable[[Request], Awaitable[Response]]

# FastAPI's own OpenTelemetry (0.16x and later): spans, metrics and logs of each request, and a look at
# the global providers on every request to know whether it is on. The gateway has its own traces
# (gateway.obs.tracing) and metrics (gateway.obs.metrics), so FastAPI's stay off; an older FastAPI
# has no such option.
_NO_FASTAPI_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


async def _unreached(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError(f"not a hot route: {scope.get('method')} {scope.get('path')}")


class _Gateway(FastAPI):
    """The app, whose hot routes (exact method and path: the chat, completion, decision, embedding
    and response doors) enter at the top: the tracing middleware and the edge, then the door, past
    FastAPI's and Starlette's own layers (FastAPI's telemetry and body-limit middleware, Starlette's
    error middleware, router and per-route exception wrapper), which they do not use: each door
    answers its own errors, and the edge anything else, as it does for every other route inside the
    usual stack (issue 35: less time a request, measured in docs/benchmarks.md)."""

    hot: dict[tuple[str, str], Endpoint]  # both set by create_app
    hot_edge: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["method"], scope["path"]) in self.hot:
            if self.root_path:
                scope["root_path"] = self.root_path
            scope["app"] = self
            await self.hot_edge(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _exact(routes: list[HTTPRoute]) -> dict[tuple[str, str], Endpoint]:
    """The hot routes without path parameters, by method and path."""
    return {(m, r.path): r.endpoint for r in routes if "{" not in r.path for m in r.methods or ()}


REQUEST_ID = b"x-request-id"


def with_request_id(scope: Scope, headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An answer's headers with an ``x-request-id``, errors' included: a door's (its exchange's id)
    is kept; any other answer (a 404 for no route, a 400 FastAPI's validation gave, a 500 of the
    edge, a page) gets the one the client sent, else a new one."""
    out = list(headers)
    if any(name.lower() == REQUEST_ID for name, _ in out):
        return out
    sent = next((v for k, v in scope.get("headers") or () if k == REQUEST_ID), None)
    out.append((REQUEST_ID, sent or uuid.uuid4().hex.encode()))
    return out


class _Edge:
    """The edge: the one place that catches everything, so the server keeps serving. An exception a
    route lets out becomes a 500 in the API's shape and a log event with its traceback, and goes no
    further: Starlette's last-resort handler would re-raise it to uvicorn, which then drops the
    keep-alive connection without a ``Connection: close``. An answer already started cannot be
    replaced: that exception goes on, and the server closes the connection, as it must.

    ``hot``: the hot routes by exact method and path, called from here (the app's own edge at its
    top, :class:`_Gateway`), past Starlette's error middleware, router and per-route exception
    wrapper (their doors answer every TriageError themselves, and the edge anything else): 8% less
    gateway CPU a request in the overhead bench's same-run pair (docs/benchmarks.md)."""

    def __init__(self, app: ASGIApp, hot: dict[tuple[str, str], Endpoint] | None = None) -> None:
        self.app = app
        self.hot = hot or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        after: list[Callable[[], Awaitable[None]]] = []
        scope[AFTER] = after  # the doors' bookkeeping, run once the answer is out (doors.after_answer)

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = with_request_id(scope, message.get("headers") or [])
            await send(message)

        try:
            endpoint = self.hot.get((scope["method"], scope["path"]))
            if endpoint is None:
                await self.app(scope, receive, watch)
            else:
                scope["endpoint"] = endpoint  # the span's route name (gateway.obs.tracing)
                response = await endpoint(Request(scope, receive, watch))
                await response(scope, receive, watch)
        except Exception:  # the edge (see above)
            log.exception("unhandled_error", method=scope.get("method"), path=scope.get("path"), started=started)
            if started:
                raise
            failed = TriageError("The server had an error while processing your request")
            await error_response(failed, scope.get("path"))(scope, receive, watch)
        finally:
            for step in after:  # also where sending failed: the slot and the runtime pin are given back
                try:
                    await step()
                except Exception:  # the answer is out: logged, and the connection stays open
                    log.exception("bookkeeping_failed", method=scope.get("method"), path=scope.get("path"))
