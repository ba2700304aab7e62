"""The servers of a benchmark, each its own process on a free loopback port.

Every process starts in its own session (so its workers can be stopped with it), writes its
output to a log file in the run's temp dir, is polled until it answers, and is always stopped:
:class:`Fleet` is a context manager that terminates what it started, then kills what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import aiohttp

HOST = "127.0.0.1"
# proxies and network fetches off for every child: all traffic stays on loopback
CHECKOUT = Path(__file__).resolve().parents[1]
_SCRUB = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "DATABASE_URL",
    "DIRECT_URL",
    "REDIS_URL",
    "REDIS_HOST",
)
LITELLM_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # the bundled cost map, no fetch from GitHub
    "LITELLM_TELEMETRY_DISABLED": "true",
    "LITELLM_MODE": "PRODUCTION",  # no load_dotenv() from the working directory
    "LITELLM_LOG": "WARNING",  # same log level as the triage row; uvicorn's access log is off too
    "LITELLM_DONT_SHOW_FEEDBACK_BOX": "true",
    "DISABLE_SCHEMA_UPDATE": "true",
    # no master key, like the triage rows (no API keys): the proxy refuses that unless told;
    # it listens on 127.0.0.1 only
    "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
}


class StartFailed(RuntimeError):
    """A server did not come up; the message says why, with the tail of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    # `python -m benchmarks.upstream` from any working folder: the checkout (benchmarks/ is not installed)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


@dataclass
class Proc:
    name: str
    argv: list[str]
    port: int
    ready_path: str
    log_path: Path
    env: dict[str, str] = field(default_factory=child_env)
    cwd: Path | None = None
    popen: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        assert self.popen is not None
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise StartFailed(f"{self.name} exited with code {self.popen.returncode}:\n{self.log_tail()}")
            try:
                async with session.get(self.base + self.ready_path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    await r.read()
                    if r.status < 400:
                        return
                    last = f"HTTP {r.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.2)
        raise StartFailed(f"{self.name} not ready after {timeout_s:.0f} s ({last}):\n{self.log_tail()}")

    async def wait_workers(self, session: aiohttp.ClientSession, n: int, timeout_s: float) -> None:
        """Until ``n`` workers of a ``triage serve --workers`` serve (the first answers before the rest
        are up): each has set its ``triage_worker_start_time_seconds`` series in ``/metrics``."""
        deadline = time.monotonic() + timeout_s
        up = 0
        while time.monotonic() < deadline:
            async with session.get(self.base + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                text = await r.text()
            up = len(re.findall(r'^triage_worker_start_time_seconds\{pid="\d+"\} [1-9]', text, re.M))
            if up >= n:
                return
            await asyncio.sleep(0.2)
        raise StartFailed(f"{self.name}: {up} of {n} workers serving after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 8.0, sig: signal.Signals = signal.SIGTERM) -> None:
        """``sig`` to the process's own session, then SIGKILL to what is left after ``grace_s``."""
        p = self.popen
        if p is None:
            return
        if p.poll() is None:
            _signal_group(p.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(grace_s)
        _signal_group(p.pid, signal.SIGKILL)  # workers a parent left behind
        if p.poll() is None:
            p.wait(5)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # the session we created: pgid == pid


class Fleet:
    """The processes of one run; leaving the block stops them all, whatever happened."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Proc] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        for p in reversed(self.procs):
            p.stop()

    def add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        proc.start()
        return proc

    def upstream(self) -> Proc:
        port = free_port()
        return self.add(
            Proc(
                "upstream",
                [sys.executable, "-m", "benchmarks.upstream", "--port", str(port)],
                port,
                "/v1/models",
                self.workdir / "upstream.log",
            )
        )

    def triage(
        self,
        name: str,
        upstream: Proc,
        level: str,
        pre: list[str] | None = None,
        workers: int = 1,
        traced: float | None = None,
        source: Path | None = None,
        extra: str = "",
    ) -> Proc:
        """``pre``: interpreter arguments before ``-m gateway.cli`` (a profiler, say); ``workers``:
        ``triage serve --workers N`` (its workers stay in the parent's session, so stop and the CPU
        meters reach them); ``traced``: spans kept at this ratio, exported to the upstream's OTLP sink;
        ``source``: another checkout of triage to run instead of this one (its packages first on the
        path, in the same virtualenv: a before/after pair in one run); ``extra``: policy text added."""
        port = free_port()
        policy = self.workdir / f"{name}.yaml"
        text = triage_policy(upstream.base + "/v1", level) + extra
        if traced is not None:
            text += f'tracing: {{otlp_endpoint: "{upstream.base}", sample_ratio: {traced}}}\n'
        policy.write_text(text)
        argv = [
            sys.executable,
            *(pre or []),
            "-m",
            "gateway.cli",
            "serve",
            "--policy",
            str(policy),
            "--host",
            HOST,
            "--port",
            str(port),
            "--no-watch",
            *(["--workers", str(workers)] if workers > 1 else []),
        ]
        proc = Proc(name, argv, port, "/v1/models", self.workdir / f"{name}.log")
        if source is not None:
            proc.cwd, proc.env = source, {**proc.env, "PYTHONPATH": str(source)}
        return self.add(proc)

    def litellm(self, upstream: Proc) -> Proc:
        exe = litellm_exe()
        if not exe.exists():
            raise StartFailed(f"the LiteLLM proxy is not installed ({exe} is missing): make bench-overhead builds it")
        port = free_port()
        cfg = self.workdir / "litellm.yaml"
        cfg.write_text(litellm_config(upstream.base + "/v1"))
        argv = [
            str(exe),
            "--config",
            str(cfg),
            "--host",
            HOST,
            "--port",
            str(port),
            "--num_workers",
            "1",
            "--telemetry",
            "False",
        ]
        return self.add(
            Proc(
                "litellm",
                argv,
                port,
                "/health/liveliness",
                self.workdir / "litellm.log",
                env=child_env(LITELLM_ENV),
                cwd=self.workdir,
            )
        )


def litellm_exe() -> Path:
    """The LiteLLM proxy's command: ``TRIAGE_LITELLM``, else the checkout's ``.venv-litellm`` (its own
    virtualenv, built by ``make bench-overhead``), else one beside this interpreter."""
    if (given := os.environ.get("TRIAGE_LITELLM")) is not None:
        return Path(given)
    own = Path(__file__).resolve().parents[1] / ".venv-litellm" / "bin" / "litellm"
    return own if own.exists() else Path(sys.executable).with_name("litellm")


def triage_policy(api_base: str, level: str) -> str:
    return f"""version: 1
backends:
  upstream:
    type: openai
    replicas:
      - {{api_base: "{api_base}"}}
    health: {{enabled: false}}
models:
  bench:
    backend: upstream
limits:
  max_concurrency: 4096
logging:
  level: {level}
  format: json
"""


def litellm_config(api_base: str) -> str:
    return f"""model_list:
  - model_name: bench
    litellm_params:
      model: openai/bench
      api_base: "{api_base}"
      api_key: x
litellm_settings:
  telemetry: false
  set_verbose: false
  drop_params: true
general_settings: {{}}
"""


async def start_redis(fleet: Fleet, workdir: Path) -> Proc | None:
    """A ``redis-server`` on a free loopback port (no persistence), stopped with the fleet; None
    where Debian's redis-server is not installed."""
    import shutil

    import redis.asyncio as aioredis

    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no", "--dir", str(workdir)]
    proc = fleet.add(Proc("redis", argv, port, "", workdir / "redis.log"))
    client = aioredis.Redis(host=HOST, port=port)
    try:
        for _ in range(200):
            try:
                await client.ping()
                return proc
            except (OSError, aioredis.ConnectionError):
                await asyncio.sleep(0.05)
    finally:
        await client.aclose()
    raise StartFailed("redis-server did not answer")
