"""Local engines in supervised worker processes: a native fault costs that engine's requests,
never the gateway.

One worker process per GGUF file (``backends.engine_worker``) holds the weights once; every
backend on the file (the default's ``local`` chat backend and its ``scorer`` both read one file)
opens an engine, a context of its own, in that process. This module is the gateway's side:

- it starts the worker, opens the engines (one token each: a kernel that faults does so there);
- it sends jobs and bounds each by its deadline, from the moment the job is submitted (the
  queue before the engine's context is part of the wait); a job past its deadline is cancelled
  in the worker (at its next token), and a worker that does not let go of it within
  ``HANG_GRACE_S`` is killed and replaced;
- when the worker dies (SIGSEGV, SIGABRT, SIGKILL, out of memory), its running jobs fail with
  :class:`~policies.errors.EngineCrashed` (502) and what they asked is remembered
  (``backends.crash_guard``); the jobs it had not started go to its successor, however many
  workers die first (each ends at its own deadline at the latest); jobs that ran side by side, not
  streamed, run again each alone, so the one that did not crash it is answered; the worker is
  restarted with a backoff that doubles while it keeps dying before serving (``MAX_BACKOFF_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
import structlog

from backends import crash_guard
from backends.crash_guard import Caller, Suspect
from backends.engine_wire import frame, frame_length
from backends.remote import too_long
from policies.errors import EngineCrashed, EngineUnavailable, InvalidRequest, UpstreamError, UpstreamTimeout

log = structlog.get_logger("triage.engines")

HANG_GRACE_S = 10.0  # a cancelled job's worker must let go within this (a long prefill runs to its end)
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 60.0
OPEN_TIMEOUT_S = 300.0  # loading a file and one token (a cold 1.5B model from a slow disk)


@dataclass(frozen=True)
class EngineSpec:
    kind: Literal["chat", "scorer", "hidden"]
    n_ctx: int
    n_threads: int
    n_batch: int
    chat_format: str | None = None


@dataclass(eq=False)
class _Job:
    id: int
    engine: str
    method: str
    args: dict[str, Any]
    stream: bool
    result: asyncio.Future[Any]
    chunks: asyncio.Queue[tuple[str, Any]] | None = None
    caller: Caller | None = None  # whose request (crash_guard.CALLER when it was submitted)
    started: bool = False
    sent: int = 0  # to how many workers
    on: int | None = None  # the worker (its generation) it was last sent to
    alone: bool = False  # it was running beside another job when their worker died: run it again, alone
    abandoned: bool = False  # the caller stopped waiting (deadline, client gone)


def _signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "unknown"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-returncode).name
        return f"signal {-returncode}"
    return f"exit {returncode}"


@dataclass(eq=False)
class Host:
    """The worker process of one file and the engines open on it."""

    path: Path
    label: str  # the file's name, for logs and errors
    specs: dict[str, EngineSpec] = field(default_factory=dict)  # engines the gateway wants open
    opened: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # per engine, this worker
    problems: dict[str, str] = field(default_factory=dict)  # engine -> why it is down
    restarts: int = 0
    last_exit: str | None = None
    _proc: asyncio.subprocess.Process | None = None
    _jobs: dict[int, _Job] = field(default_factory=dict)
    _next_id: int = 0
    _up: asyncio.Event = field(default_factory=asyncio.Event)
    _stderr: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _failures: int = 0  # deaths in a row before a job was served
    _served: bool = False
    _closing: bool = False
    _restart: asyncio.Task[None] | None = None
    _generation: int = 0  # the workers started so far
    _alone: list[_Job] = field(default_factory=list)  # suspects to run one at a time, nothing beside them

    # ---- engines -----------------------------------------------------------------------------

    async def open(self, eid: str, spec: EngineSpec) -> None:
        """Open an engine (starting the worker if needed); EngineUnavailable with the reason if
        the file does not load or its first token fails."""
        self.specs[eid] = spec
        self.problems.pop(eid, None)
        if self._proc is None and self._restart is None:
            await self._spawn()
        elif self._up.is_set():
            self._send_open(eid)
        await self._wait_open(eid)

    async def _wait_open(self, eid: str) -> None:
        try:
            await asyncio.wait_for(self._opening(eid), OPEN_TIMEOUT_S)
        except TimeoutError:
            self.problems[eid] = f"did not load within {OPEN_TIMEOUT_S:g}s"
            raise EngineUnavailable(f"local model {self.label} is unavailable: {self.problems[eid]}") from None

    async def _opening(self, eid: str) -> None:
        while True:
            await self._up.wait()
            fut = self.opened.get(eid)
            if fut is None:  # a worker that died before it was asked: the next one will be
                await asyncio.sleep(0.05)
                continue
            with contextlib.suppress(EngineCrashed):
                await asyncio.shield(fut)
                if eid not in self.problems:
                    return
            if eid in self.problems:
                raise EngineUnavailable(f"local model {self.label} is unavailable: {self.problems[eid]}")

    async def close_engine(self, eid: str) -> None:
        self.specs.pop(eid, None)
        self.opened.pop(eid, None)
        if self._up.is_set():
            self._write({"op": "close", "engine": eid})
        if not self.specs:
            await self.stop()

    def healthy(self, eid: str) -> bool:
        fut = self.opened.get(eid)
        return (
            self._up.is_set()
            and fut is not None
            and fut.done()
            and not fut.cancelled()
            and fut.exception() is None
            and eid not in self.problems
        )

    def problem(self, eid: str) -> str | None:
        if eid in self.problems:
            return self.problems[eid]
        if not self._up.is_set():
            return f"restarting after {self.last_exit}" if self.last_exit else "starting"
        return None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- jobs --------------------------------------------------------------------------------

    def _submit(self, eid: str, method: str, args: dict[str, Any], stream: bool) -> _Job:
        if eid in self.problems:
            raise EngineUnavailable(f"local model {self.label} is unavailable: {self.problems[eid]}")
        if eid not in self.specs:
            raise UpstreamError(f"local model {self.label} is not open")
        kind = self.specs[eid].kind
        crash_guard.guard().admit(self.label, lambda: crash_guard.fingerprint(kind, method, args))
        self._next_id += 1
        loop = asyncio.get_running_loop()
        job = _Job(self._next_id, eid, method, args, stream, loop.create_future(), caller=crash_guard.CALLER.get())
        if stream:
            job.chunks = asyncio.Queue()
        self._jobs[job.id] = job
        if self._up.is_set() and not self._alone:
            self._send_job(job)
        return job  # else sent when the worker is back, or once the jobs to run alone are done

    def _send_job(self, job: _Job) -> None:
        msg = {"op": "run", "id": job.id, "engine": job.engine, "method": job.method, "args": job.args}
        try:
            data = frame({**msg, "stream": job.stream})
        except orjson.JSONEncodeError as exc:  # a lone surrogate, say: it cannot cross the pipe
            self._finish(job, InvalidRequest(f"the request cannot be sent to local model {self.label}: {exc}"))
            return
        job.sent += 1
        job.on = self._generation
        self._write_frame(data)

    def _abandon(self, job: _Job) -> None:
        """The caller stopped waiting: stop the job in the worker; a worker that keeps running it
        past the grace is hung, and replaced."""
        if job.result.done() or job.abandoned:
            return
        job.abandoned = True
        if job.on != self._generation or self._proc is None:  # this worker never had it
            self._finish(job)
            return
        self._write({"op": "cancel", "id": job.id})
        proc = self._proc
        self._spawn_task(self._watch(job, proc))

    async def _watch(self, job: _Job, proc: asyncio.subprocess.Process | None) -> None:
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(job.result), HANG_GRACE_S)
        if not job.result.done() and proc is not None and proc is self._proc and proc.returncode is None:
            log.warning("engine_hung", model=self.label, pid=proc.pid, job=job.method, grace_s=HANG_GRACE_S)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def _finish(self, job: _Job, exc: BaseException | None = None, value: Any = None) -> None:
        self._jobs.pop(job.id, None)
        if job in self._alone:
            self._alone.remove(job)
            self._send_waiting()
        if job.result.done():
            return
        if exc is not None:
            job.result.set_exception(exc)
            job.result.exception()  # retrieved: an abandoned job's failure is nobody's to report
        else:
            job.result.set_result(value)
        if job.chunks is not None:
            job.chunks.put_nowait(("end", None))

    async def call(self, eid: str, method: str, args: dict[str, Any], timeout_s: float) -> Any:
        """A job's result; its deadline covers the wait for the worker and for the context."""
        job = self._submit(eid, method, args, stream=False)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(job.result)
        except TimeoutError:
            self._abandon(job)
            raise UpstreamTimeout(f"local model {self.label} timed out after {timeout_s:g}s") from None
        except asyncio.CancelledError:
            self._abandon(job)
            raise

    async def stream(
        self, eid: str, method: str, args: dict[str, Any], first_byte_s: float, idle_s: float, total_s: float
    ) -> AsyncGenerator[Any, None]:
        """A job's chunks, then its result as the last item; the first within ``first_byte_s`` of
        submitting, each next within ``idle_s``, all within ``total_s``. Closing the iterator
        early cancels the job."""
        job = self._submit(eid, method, args, stream=True)
        assert job.chunks is not None
        deadline = time.monotonic() + total_s
        first = True
        try:
            while True:
                wait = min(first_byte_s if first else idle_s, deadline - time.monotonic())
                try:
                    async with asyncio.timeout(max(wait, 0.0)):
                        kind, item = await job.chunks.get()
                except TimeoutError:
                    what = "first token" if first else "next token"
                    raise UpstreamTimeout(f"local model {self.label} timed out waiting for its {what}") from None
                if kind == "chunk":
                    first = False
                    yield item
                    continue
                yield job.result.result()  # "end": the result, or the job's error raised
                return
        finally:
            self._abandon(job)

    # ---- the process -------------------------------------------------------------------------

    async def _spawn(self) -> None:
        self._up.clear()
        self.opened = {}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "backends.engine_worker",
            str(self.path),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=2**20,
        )
        self._proc = proc
        self._generation += 1
        self._served = False
        self._stderr.clear()  # a crash's log shows its own worker's last words
        log.info("engine_started", model=self.label, pid=proc.pid, engines=sorted(self.specs))
        self._spawn_task(self._read(proc))
        self._spawn_task(self._tail(proc))

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _write(self, message: dict[str, Any]) -> None:
        self._write_frame(frame(message))

    def _write_frame(self, data: bytes) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            proc.stdin.write(data)

    def _send_open(self, eid: str) -> None:
        spec = self.specs[eid]
        self.opened[eid] = asyncio.get_running_loop().create_future()
        self._write(
            {
                "op": "open",
                "engine": eid,
                "kind": spec.kind,
                "n_ctx": spec.n_ctx,
                "n_threads": spec.n_threads,
                "n_batch": spec.n_batch,
                "chat_format": spec.chat_format,
            }
        )

    async def _tail(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            self._stderr.append(line.decode("utf-8", "replace").rstrip())

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        try:
            while True:
                header = await proc.stdout.readexactly(4)
                message = orjson.loads(await proc.stdout.readexactly(frame_length(header)))
                self._on_message(message)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, orjson.JSONDecodeError):
            pass
        await self._died(proc)

    def _send_waiting(self) -> None:
        """Send the worker what it does not hold yet: the next job to run alone while there is one
        (nothing beside it), else every job waiting."""
        if not self._up.is_set():
            return
        for job in self._alone[:1] if self._alone else list(self._jobs.values()):
            if job.on != self._generation:
                self._send_job(job)

    def _on_message(self, m: dict[str, Any]) -> None:
        ev = m.get("ev")
        if ev == "hello":
            for eid in sorted(
                self.specs, key=lambda e: self.specs[e].kind != "chat"
            ):  # chat first: its model is shared
                self._send_open(eid)
            self._up.set()
            for job in list(self._jobs.values()):  # waiting for this worker: none has run to its end
                if job.abandoned or job.engine not in self.specs:
                    self._finish(job, UpstreamError(f"local model {self.label} was closed"))
            self._send_waiting()
            return
        if ev in ("opened", "open_failed"):
            fut = self.opened.get(m["engine"])
            if ev == "open_failed":
                self.problems[m["engine"]] = str(m.get("message") or "failed to open")
                log.error("engine_open_failed", model=self.label, engine=m["engine"], reason=self.problems[m["engine"]])
            if fut is not None and not fut.done():
                fut.set_result(None)
            return
        found = self._jobs.get(int(m.get("id", -1)))
        if found is None:
            return
        job = found
        if ev == "started":
            job.started = True
        elif ev == "chunk":
            if job.chunks is not None:
                job.chunks.put_nowait(("chunk", m["data"]))
        elif ev == "done":
            self._served = True
            self._failures = 0
            self._finish(job, value=m.get("data"))
        elif ev == "error":
            self._served = True
            kind, message = m.get("kind"), str(m.get("message"))
            if kind == "invalid":
                exc: Exception = InvalidRequest(message, code="context_length_exceeded" if too_long(message) else None)
            elif kind == "cancelled":
                exc = UpstreamTimeout(f"local model {self.label}: the job was cancelled")
            else:
                exc = UpstreamError(f"local model {self.label} failed", retryable=False, detail=message)
            self._finish(job, exc)

    async def _died(self, proc: asyncio.subprocess.Process) -> None:
        rc = await proc.wait()
        if proc is not self._proc:
            return
        self._proc = None
        self._up.clear()
        if self._closing:
            return
        why = _signal_name(rc)
        self.last_exit = why
        self.restarts += 1
        loading = [e for e, f in self.opened.items() if not f.done()]
        for eid in loading:  # died opening it: the file or its first token kills the process
            self.problems[eid] = f"the worker died ({why}) loading the model or running its first token"
        started = [j for j in self._jobs.values() if j.started]
        again = [j for j in started if len(started) > 1 and not (j.stream or j.abandoned or j.alone)]
        running = [j for j in self._jobs.values() if (j.started or j.abandoned) and j not in again]
        guard = crash_guard.guard()
        log.error(
            "engine_crashed",
            model=self.label,
            pid=proc.pid,
            signal=why,
            running=len(running),
            waiting=len(self._jobs) - len(running),
            loading=loading,
            **guard.stderr(list(self._stderr)[-5:]),
        )
        guard.crashed(self.label, [self._suspect(j) for j in started])
        for job in again:  # either may have crashed it: each runs again with nothing beside it
            job.alone = True
            self._alone.append(job)
        for fut in self.opened.values():
            if not fut.done():
                fut.set_exception(EngineCrashed(f"local model {self.label} crashed ({why})"))
                fut.exception()
        for job in running:
            self._finish(job, EngineCrashed(f"local model {self.label} crashed ({why}) while answering; it restarts"))
        for job in self._jobs.values():
            job.started = False
        if not self._served:
            self._failures += 1
        delay = min(FIRST_BACKOFF_S * 2 ** max(self._failures - 1, 0), MAX_BACKOFF_S) if self._failures else 0.0
        self._restart = asyncio.get_running_loop().create_task(self._respawn(delay))

    def _suspect(self, job: _Job) -> Suspect:
        kind = self.specs[job.engine].kind if job.engine in self.specs else "closed"
        return Suspect(lambda: crash_guard.fingerprint(kind, job.method, job.args), job.caller)

    async def _respawn(self, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
            if not self._closing and self.specs:
                for eid in list(self.problems):  # tried again: a crash at load may have been the machine's
                    if self.problems[eid].startswith("the worker died"):
                        self.problems.pop(eid)
                await self._spawn()
        finally:
            self._restart = None

    async def stop(self) -> None:
        """Stop the worker (its jobs fail), for good."""
        self._closing = True
        if self._restart is not None:
            self._restart.cancel()
        proc, self._proc = self._proc, None
        self._up.clear()
        for job in list(self._jobs.values()):
            self._finish(job, UpstreamError(f"local model {self.label} was closed"))
        if proc is not None and proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for task in list(self._tasks):
            task.cancel()
        _HOSTS.pop(_key(self.path), None)


_HOSTS: dict[tuple[int, str], Host] = {}


def _key(path: Path) -> tuple[int, str]:
    return id(asyncio.get_running_loop()), str(path.resolve())


def host_for(path: Path) -> Host:
    """The one worker of a file in this event loop (backends on one file share it)."""
    key = _key(path)
    host = _HOSTS.get(key)
    if host is None or host._closing:
        host = _HOSTS[key] = Host(path, path.name)
    return host
