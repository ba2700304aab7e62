"""``triage serve --workers N``: N worker processes on one port, and the parent that keeps them.

The parent binds the port, points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh private folder (removed
at exit; see :mod:`gateway.obs.metrics`), and starts the workers with multiprocessing's ``spawn``:
each is a fresh interpreter that builds its own runtime from the policy file under its own
uvicorn. On Linux each worker listens on a socket of its own bound to the same port with
``SO_REUSEPORT``, and the kernel spreads new connections over the listening workers by a hash of
each connection (a keep-alive connection stays with its worker), where with one socket shared by
every worker whichever wakes first takes what is queued, and a burst can land on one. The parent's
own socket, bound but never listening, holds the port while workers come and go. Elsewhere,
the workers share that one socket. Then it keeps them:

- a worker that dies after it served is replaced: at once if it had lived 30 s, else after a
  backoff (1 s doubling to 30 s) so that a crash loop does not spin; its counters stay in the
  metrics folder, so ``/metrics`` totals never go back;
- a worker of the first start that exits before it serves (a model, a backend or the state
  store will not load; every worker would fail alike) stops the whole server, exit 3; a
  replacement that exits before it serves is retried with the same backoff while the others
  serve;
- SIGHUP is passed on to every worker, and each reloads the policy as one process does (a
  worker still starting ignores it: it reads the file as it starts); each worker also watches
  the file itself;
- SIGTERM or SIGINT stop every worker (each finishes its requests, 10 s at most, as one process
  does), then the parent; a worker hung past 15 s is killed. A worker whose parent died without
  stopping it (SIGKILL) stops by itself within a second or so.

What each worker keeps for itself, and what it shares only through the policy's stores, is in
docs/operations.md ("Several workers"): with ``state.store: memory`` a key's limits would be
counted per worker, and keys made through /admin known to one worker only, so the serve command
refuses those on it (see :func:`policies.processes.per_process_problems`), at start, on reload and in a replacement
worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import structlog

from gateway.http.settings import Settings
from gateway.obs.metrics import MULTIPROC_ENV

log = structlog.get_logger("triage.workers")

STARTUP_FAILURE = 3  # uvicorn's exit code for a server that never started
TICK_S = 0.5
STOP_GRACE_S = 15.0  # a worker's graceful shutdown is 10 s
LONG_LIFE_S = 30.0
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


def bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet: uvicorn listens on it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def reuse_port() -> bool:
    """Whether the workers each listen with SO_REUSEPORT (Linux: the kernel balances connections)."""
    return sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")


def worker_main(
    settings_json: str, listen: socket.socket | tuple[str, int], options: dict[str, Any], serving: Connection
) -> None:
    """One worker process: the gateway under uvicorn, on the parent's socket or (``(host, port)``)
    on its own SO_REUSEPORT socket. Says so on ``serving`` once it serves."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until its reloader takes SIGHUP over
    threading.Thread(target=_stop_when_orphaned, args=(os.getppid(),), daemon=True).start()
    import uvicorn

    from gateway.http import connections
    from gateway.http.app import create_app
    from policies import loader
    from policies.errors import PolicyInvalid
    from policies.schema import Limits

    if isinstance(listen, tuple):
        try:
            sock = bind(*listen, reuse_port=True)
        except OSError as exc:
            log.error("worker_bind_failed", pid=os.getpid(), address=f"{listen[0]}:{listen[1]}", error=str(exc))
            sys.exit(STARTUP_FAILURE)
    else:
        sock = listen
    settings = Settings.model_validate_json(settings_json)
    try:  # checked by the parent; read again here for the server's guards
        limits = loader.load(settings.policy_path).limits
    except PolicyInvalid:  # changed since: the app's start-up says what is wrong
        limits = Limits()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), **connections.uvicorn_options(options, limits)))
    threading.Thread(target=_say_when_serving, args=(server, serving), daemon=True).start()
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches the workers too: a stop, not a failure
        server.run(sockets=[sock])
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def _say_when_serving(server: Any, serving: Connection) -> None:
    while not server.started:  # set by uvicorn once the lifespan has started and the socket listens
        if server.should_exit:
            return
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        serving.send_bytes(b"1")


def _stop_when_orphaned(parent: int) -> None:
    """A worker whose parent died (SIGKILL, a crash) stops as on SIGTERM, rather than hold the port
    with no one to replace it or its siblings."""
    while os.getppid() == parent:
        time.sleep(1.0)
    log.error("worker_orphaned", pid=os.getpid(), parent=parent, action="stopping")
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class _Slot:
    index: int
    process: BaseProcess | None = None
    serving: Connection | None = None  # the worker writes once it serves; None once it has
    born: float = 0.0
    starts: int = 0
    short_lives: int = 0  # deaths in a row before LONG_LIFE_S
    restart_at: float | None = None


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        listen: socket.socket | tuple[str, int],
        workers: int,
        options: dict[str, Any],
        metrics_dir: str,
    ) -> None:
        """``listen``: the socket every worker accepts on, or the address each binds with SO_REUSEPORT."""
        self.settings_json = settings.model_copy(update={"workers": workers}).model_dump_json()
        self.listen = listen
        self.options = options
        self.metrics_dir = metrics_dir
        self.slots = [_Slot(i) for i in range(workers)]
        self.signals: list[int] = []
        self._ctx = multiprocessing.get_context("spawn")
        self._all_served = False

    def run(self) -> int:
        """Start the workers and keep them until SIGTERM or SIGINT; the exit code."""
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {s: signal.signal(s, lambda sig, _frame: self.signals.append(sig)) for s in handled}
        try:
            for slot in self.slots:
                self._start(slot)
            log.info("workers_started", parent=os.getpid(), workers=self.pids())
            return self._keep()
        finally:
            self._stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.slots if s.process is not None and s.process.pid is not None]

    def _keep(self) -> int:
        while True:
            watched: list[Any] = [s.process.sentinel for s in self.slots if s.process is not None]
            wait(watched + [s.serving for s in self.slots if s.serving is not None], timeout=TICK_S)
            while self.signals:
                sig = self.signals.pop(0)
                if sig != signal.SIGHUP:
                    log.info("workers_stopping", signal=signal.Signals(sig).name, workers=self.pids())
                    return 0
                self._forward(signal.SIGHUP)
            now = time.monotonic()
            for slot in self.slots:
                self._check_serving(slot)
                if slot.process is not None and slot.process.exitcode is not None and self._reap(slot, now):
                    return STARTUP_FAILURE
                if slot.process is None and slot.restart_at is not None and now >= slot.restart_at:
                    log.info("worker_replaced", slot=slot.index, pid=self._start(slot))
            if not self._all_served and all(s.process is not None and s.serving is None for s in self.slots):
                self._all_served = True
                log.info("workers_serving", parent=os.getpid(), workers=self.pids())

    def _start(self, slot: _Slot) -> int | None:
        reader, writer = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=worker_main,
            args=(self.settings_json, self.listen, self.options, writer),
            name=f"triage-worker-{slot.index}",
        )
        process.start()
        writer.close()  # the worker's end
        slot.process, slot.serving, slot.born, slot.restart_at = process, reader, time.monotonic(), None
        slot.starts += 1
        return process.pid

    def _check_serving(self, slot: _Slot) -> None:
        """Whether the slot's worker said it serves (then its pipe is done with)."""
        if slot.serving is None:
            return
        with contextlib.suppress(EOFError, OSError):
            if slot.serving.poll() and slot.serving.recv_bytes():
                slot.serving.close()
                slot.serving = None

    def _reap(self, slot: _Slot, now: float) -> bool:
        """A worker that exited: True when the whole server must stop (one of the first start never
        served); else its replacement is scheduled."""
        from prometheus_client.multiprocess import mark_process_dead

        assert slot.process is not None
        pid, code = slot.process.pid, slot.process.exitcode
        slot.process.join()
        slot.process.close()
        slot.process = None
        failed_start = slot.serving is not None  # it exited before it ever served
        if slot.serving is not None:
            slot.serving.close()
            slot.serving = None
        mark_process_dead(pid, self.metrics_dir)  # its live gauges go; its counters stay
        if failed_start and slot.starts == 1:
            log.error("worker_start_failed", slot=slot.index, pid=pid, exitcode=code, action="stopping the server")
            return True
        lived = now - slot.born
        slot.short_lives = 0 if lived >= LONG_LIFE_S and not failed_start else slot.short_lives + 1
        delay = BACKOFF_S[min(slot.short_lives, len(BACKOFF_S)) - 1] if slot.short_lives else 0.0
        slot.restart_at = now + delay
        event = "worker_start_failed" if failed_start else "worker_died"
        log.error(event, slot=slot.index, pid=pid, exitcode=code, lived_s=round(lived, 1), restart_in_s=delay)
        return False

    def _forward(self, sig: signal.Signals) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        log.info("signal_forwarded", signal=sig.name, workers=self.pids())

    def _stop_all(self) -> None:
        live = [s.process for s in self.slots if s.process is not None and s.process.exitcode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid or 0, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in live:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in live:
            if p.exitcode is None:
                log.error("worker_killed", pid=p.pid, after_s=STOP_GRACE_S)
                p.kill()
                p.join(5)


def supervise(settings: Settings, host: str, port: int, workers: int, options: dict[str, Any]) -> int:
    """Serve with ``workers`` processes until SIGTERM or SIGINT; the exit code."""
    reuse = reuse_port()
    try:
        held = bind(host, port, reuse)  # the port is ours (or the error is now, and clear)
    except OSError as exc:
        log.error("bind_failed", address=f"{host}:{port}", error=str(exc))
        return STARTUP_FAILURE
    metrics_dir = tempfile.mkdtemp(prefix="triage-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir  # before any worker imports prometheus-client
    try:
        with held:
            listen = (host, held.getsockname()[1]) if reuse else held
            return Supervisor(settings, listen, workers, options, metrics_dir).run()
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)
