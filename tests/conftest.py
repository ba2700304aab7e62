"""Fixtures: a real llama.cpp server as the pool, and the gateway under a real uvicorn."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from backends.gguf import smollm2_path
from benchmarks import vllm as vllm_engine
from gateway.http.app import create_app
from gateway.http.settings import Settings
from tests import lanes
from tests.servers import database, free_port, pg, redis_url  # noqa: F401 - fixtures: real Redis, PostgreSQL

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    have_data = (SHARED_DATA / "typed").is_dir()
    if not have_data and os.environ.get("CI") == "true":
        raise pytest.UsageError(
            f"the shared data is not at {SHARED_DATA}: put it beside the checkout or set TRIAGE_SHARED_DATA"
        )
    no_data = pytest.mark.skip(reason=f"the shared data is not at {SHARED_DATA}: set TRIAGE_SHARED_DATA")
    lanes.mark(items)  # engine, model: by the fixtures that start or load them (tests/lanes.py)
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if isinstance(item, pytest.Function) else ""
        fixtures = set(getattr(item, "fixturenames", ()))
        if not have_data and (module in DATA_MODULES or DATA_FIXTURES & fixtures):
            item.add_marker(no_data)


def pytest_configure(config: pytest.Config) -> None:
    # the lanes' checks, as a plugin: hooks of this conftest do not see session fixtures set up
    config.pluginmanager.register(lanes.Checks(), "lanes")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared labeled sets (tests asking for it skip where they are absent, outside CI)."""
    return SHARED_DATA


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not come up in {timeout}s")


@dataclass
class LlamaServer:
    proc: subprocess.Popen
    port: int

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class VllmServer(LlamaServer):
    """A real vLLM engine: an API server and its engine process, in a session of their own."""

    log: Path = Path()

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine process too
        if self.proc.poll() is None:
            self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def metric(self, name: str) -> float:
        """A counter of vLLM's own /metrics (summed over its labels)."""
        return vllm_engine.counters(httpx.get(self.root + "/metrics", timeout=10).text, (name,))[name]


def start_vllm_server(log_dir: Path, cpu: int | None = None, extra: tuple[str, ...] = ()) -> VllmServer:
    """vLLM's CPU build serving SmolLM2-135M (``make vllm`` builds it; ``make test`` does): where it is
    missing the tests that need it skip and say how to build it, and in CI they fail."""
    if (reason := vllm_engine.missing()) is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    port = free_port()
    log_path = log_dir / f"vllm-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            vllm_engine.argv(port, extra=extra),
            env=vllm_engine.env(dict(os.environ), cpu),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = VllmServer(proc, port, log_path)
    try:
        wait_http(server.root + vllm_engine.READY_PATH, vllm_engine.START_TIMEOUT_S, proc)
    except BaseException as exc:
        server.kill()
        raise RuntimeError(f"vLLM did not start ({exc}); its log ends:\n{server.log_tail(20)}") from None
    return server


@pytest.fixture(scope="session")
@lanes.engine
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One real vLLM engine (CPU build, SmolLM2-135M) for the whole run, on core 0, with its tool-call
    parser (tests/http/test_tool_calls.py)."""
    server = start_vllm_server(tmp_path_factory.mktemp("vllm"), cpu=0, extra=vllm_engine.TOOL_ARGS)
    yield server
    server.kill()


@pytest.fixture(scope="session")
@lanes.engine
def vllm_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A second vLLM engine, on core 1: two replicas behind one backend."""
    server = start_vllm_server(tmp_path_factory.mktemp("vllm-replica"), cpu=1)
    yield server
    server.kill()


@pytest.fixture
@lanes.engine
def spare_vllm(tmp_path: Path) -> Iterator[VllmServer]:
    """A vLLM engine of its own, for a test that kills it."""
    server = start_vllm_server(tmp_path, cpu=1)
    yield server
    server.kill()


def start_llama_server(
    log_dir: Path, extra: list[str] | None = None, model: Path | None = None, alias: str = "smollm2"
) -> LlamaServer:
    """``python -m llama_cpp.server`` on ``model`` (SmolLM2-135M by default), served as ``alias``."""
    port = free_port()
    with open(log_dir / f"llama-server-{port}.log", "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(model or smollm2_path()),
                "--model_alias",
                alias,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--n_ctx",
                "2048",
                "--n_threads",
                "1",
                "--n_threads_batch",
                "1",  # prompt threads default to every core: see docs/design.md
                # by default a new request (even a health probe) cuts short the one being generated
                "--interrupt_requests",
                "False",
                *(extra or []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = LlamaServer(proc, port)
    try:
        wait_http(server.api_base + "/models", 120, proc)
    except BaseException:
        server.kill()
        raise
    return server


@pytest.fixture(scope="session")
@lanes.engine
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """One real llama.cpp server (SmolLM2-135M) for the whole run."""
    server = start_llama_server(tmp_path_factory.mktemp("llama"))
    yield server
    server.kill()


@pytest.fixture
@lanes.engine
def spare_llama_server(tmp_path: Path) -> Iterator[LlamaServer]:
    """A second real llama.cpp server, for tests that kill one."""
    server = start_llama_server(tmp_path)
    yield server
    server.kill()


# The labeled sets: `../shared/data` beside the checkout, or TRIAGE_SHARED_DATA. Where they are
# absent, the tests that read them skip and say what to set; in CI (CI=true) their absence fails.
SHARED_DATA = Path(os.environ.get("TRIAGE_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
DATA_FIXTURES = frozenset({"trained_heads", "heads", "toy", "option_heads", "shared_data"})
DATA_MODULES = frozenset({"test_options", "test_routing"})
HEADS = ["question_type", "category", "reasoning", "injection"]


@pytest.fixture(scope="session")
@lanes.model
def trained_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The encoder's heads (``HEADS``) trained on a small seeded sample of the shared data, once per
    run, for every test that serves the encoder tier (policies: ``data_dir`` SHARED_DATA, these heads)."""
    from classifiers.training.export import ensure_exported
    from classifiers.training.train_all import train
    from policies.schema import ClassifierSpec

    ensure_exported()
    out = tmp_path_factory.mktemp("heads")
    train(
        ClassifierSpec(data_dir=str(SHARED_DATA), artifacts=str(out), heads=HEADS),
        out,
        threads=2,
        say=lambda _: None,
        limit=300,
    )
    return out


@dataclass
class Gateway:
    base_url: str
    policy_path: Path
    app: object
    clients: dict[str, openai.OpenAI] = field(default_factory=dict)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        """The official client, one per key, closed when the gateway stops."""
        if api_key not in self.clients:
            self.clients[api_key] = openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0)
        return self.clients[api_key]

    def close_clients(self) -> None:
        for client in self.clients.values():
            client.close()

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60)


class GatewayRunner:
    """Starts gateways on policies (YAML text) under a real uvicorn, each in a thread."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.servers: list[tuple[uvicorn.Server, threading.Thread]] = []
        self.gateways: list[Gateway] = []

    def start(self, policy_yaml: str, watch: bool = False) -> Gateway:
        path = self.tmp / f"policy-{len(self.servers)}.yaml"
        path.write_text(policy_yaml)
        app = create_app(Settings(policy_path=path, watch_policy=watch, handle_sighup=False, configure_logging=False))
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="asyncio")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        self.servers.append((server, thread))
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        gw = Gateway(f"http://127.0.0.1:{port}", path, app)
        self.gateways.append(gw)
        return gw

    def stop_all(self) -> None:
        for gw in self.gateways:
            gw.close_clients()
        for server, _ in self.servers:
            server.should_exit = True
        for _, thread in self.servers:
            thread.join(30)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Callable[..., Gateway]]:
    runner = GatewayRunner(tmp_path)
    yield runner.start
    runner.stop_all()


@pytest.fixture
@lanes.fleet
def gateways(tmp_path: Path) -> Iterator[Callable[[str, int], list[str]]]:
    """``start(policy_yaml, n)``: n `triage serve` processes on one policy file; their base URLs."""
    procs: list[subprocess.Popen] = []

    def start(text: str, n: int) -> list[str]:
        path = tmp_path / f"policy-{len(procs)}.yaml"
        path.write_text(text)
        urls = []
        for _ in range(n):
            port = free_port()
            cmd = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(path), "--port", str(port)]
            with (tmp_path / f"gateway-{port}.log").open("wb") as log:
                proc = subprocess.Popen([*cmd, "--no-watch"], stdout=log, stderr=subprocess.STDOUT)
            procs.append(proc)
            try:
                wait_http(f"http://127.0.0.1:{port}/health", 120, proc)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}: {(tmp_path / f'gateway-{port}.log').read_text()[-2000:]}") from None
            urls.append(f"http://127.0.0.1:{port}")
        return urls

    yield start
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(20)
