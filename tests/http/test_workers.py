"""``triage serve --workers N`` (issue 18): real processes on one port, metrics added up across them
(prometheus-client's multiprocess mode), reload in every worker, a dead worker replaced, workers
that stop with their parent, the Batch API on SQLite (one worker) and PostgreSQL (every worker),
and the refusals (``--workers 0``, a port in use, a memory store with keys that have limits or
with the admin API, a worker that cannot start)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.batch.test_batches import jsonl, line, wait_batch
from tests.batch.test_fleet_batches import fleet_policy
from tests.conftest import free_port, wait_http

pytestmark = pytest.mark.fleet  # every test here starts `triage serve --workers N`

POLICY = """version: 1
backends: {script: {type: scripted, text: "TEXT"}}
models: {scripted: {backend: script}}
"""
BODY = {"model": "scripted", "messages": [{"role": "user", "content": "hi there"}]}
ID_PREFIX = 12  # gateway.http.exchange: a generated request id starts with its process's own prefix


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    policy: Path
    tmp: Path  # the server's TMPDIR: its metrics folder lives there
    log: Path

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def workers(self) -> dict[str, float]:
        """pid -> start time of every live worker (0 while it starts)."""
        found = re.findall(r'^triage_worker_start_time_seconds\{pid="(\d+)"\} (\S+)$', self.metrics(), re.M)
        return {pid: float(v) for pid, v in found}

    def wait_workers(self, n: int, timeout: float = 90, exclude: frozenset[str] = frozenset()) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.tail()
            with_start = {p: t for p, t in self.workers().items() if t > 0 and p not in exclude}
            if len(with_start) == n:
                return with_start
            time.sleep(0.2)
        raise TimeoutError(f"{n} workers not serving after {timeout}s: {self.workers()}\n{self.tail()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self) -> str:
        return self.output()[-3000:]


def value(text: str, sample: str) -> float:
    """One sample's value in Prometheus text (0 where absent)."""
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def command(policy: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy), "--port", str(port), *extra]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """``serve(policy_yaml, *args)``: a real `triage serve ... *args` on a free port, up and answering."""
    started: list[Served] = []

    def start(text: str, *args: str) -> Served:
        n = len(started)
        policy, tmp, log = tmp_path / f"policy-{n}.yaml", tmp_path / f"tmp-{n}", tmp_path / f"serve-{n}.log"
        policy.write_text(text)
        tmp.mkdir()
        port = free_port()
        with log.open("wb") as out:
            proc = subprocess.Popen(
                command(policy, port, *args),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TMPDIR": str(tmp)},
            )
        served = Served(proc, f"http://127.0.0.1:{port}", policy, tmp, log)
        started.append(served)
        try:
            wait_http(served.url + "/health", 120, proc)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {served.tail()}") from None
        return served

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.terminate()
    for s in started:
        s.proc.wait(30)


def chat(url: str) -> httpx.Response:
    """One request on a connection of its own (the kernel picks the worker that accepts it)."""
    r = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30)
    assert r.status_code == 200, r.text
    return r


def spread(url: str, at_least: int, workers: int, most: int = 400) -> list[httpx.Response]:
    """Requests (8 at a time, each on a new connection) until ``at_least`` are done and each of the
    ``workers`` answered some (told apart by their request ids' per-process prefix)."""
    answers: list[httpx.Response] = []
    with ThreadPoolExecutor(8) as pool:
        while len(answers) < most:
            answers.extend(pool.map(lambda _: chat(url), range(8)))
            if len(answers) >= at_least and len(by_worker(answers)) == workers:
                break
    return answers


def by_worker(answers: list[httpx.Response]) -> Counter[str]:
    return Counter(r.headers["x-request-id"][:ID_PREFIX] for r in answers)


def test_two_workers_share_the_port_and_metrics_count_every_request_exactly(serve: Callable[..., Served]) -> None:
    s = serve(POLICY.replace("TEXT", "hello there"), "--workers", "2", "--no-watch")
    pids = s.wait_workers(2)
    folders = list(s.tmp.glob("triage-metrics-*"))
    assert len(folders) == 1  # the private metrics folder, in the server's TMPDIR
    counts = by_worker(spread(s.url, 40, 2))
    n = sum(counts.values())
    assert len(counts) == 2 and min(counts.values()) > 0, counts
    # every scrape, whichever worker answers it, adds up both workers' counts
    for _ in range(4):
        text = httpx.get(s.url + "/metrics", timeout=10).text  # a new connection: either worker
        assert value(text, 'triage_requests_total{endpoint="chat",model="scripted",status="200"}') == n
        assert value(text, 'triage_request_latency_seconds_count{endpoint="chat",model="scripted"}') == n
        assert value(text, 'triage_upstream_attempts_total{backend="script",outcome="ok",replica="scripted"}') == n
        assert value(text, 'triage_tokens_total{kind="prompt",model="scripted"}') == 2 * n
        assert value(text, 'triage_tokens_total{kind="completion",model="scripted"}') == 2 * n
        assert value(text, "triage_in_flight_requests") == 0  # livesum over the workers
        assert set(re.findall(r'triage_worker_start_time_seconds\{pid="(\d+)"\}', text)) == set(pids)
    # each worker's own file holds its own share
    from prometheus_client.multiprocess import MultiProcessCollector

    shares = {}
    for pid in pids:
        merged = MultiProcessCollector.merge([str(folders[0] / f"counter_{pid}.db")])
        shares[pid] = sum(x.value for m in merged if m.name == "triage_requests" for x in m.samples)
    assert sorted(shares.values()) == sorted(counts.values())
    assert '"event":"workers_serving"' in s.output()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0
    assert not list(s.tmp.glob("triage-metrics-*"))  # removed at exit


def test_a_dead_worker_is_replaced_and_its_counts_stay(serve: Callable[..., Served]) -> None:
    s = serve(POLICY.replace("TEXT", "hi"), "--workers", "2", "--no-watch")
    pids = s.wait_workers(2)
    first = len(spread(s.url, 20, 2))
    victim = sorted(pids)[0]
    os.kill(int(victim), signal.SIGKILL)
    now = s.wait_workers(2, exclude=frozenset({victim}))  # the replacement serves ...
    assert victim not in s.workers() and len(set(now) - set(pids)) == 1  # ... the victim's live gauges are gone
    second = len(spread(s.url, 20, 2))
    text = s.metrics()
    assert value(text, 'triage_requests_total{endpoint="chat",model="scripted",status="200"}') == first + second
    assert '"event":"worker_died"' in s.output() and '"worker_replaced"' in s.output()


def test_every_worker_reloads_on_a_file_change_and_on_sighup(serve: Callable[..., Served]) -> None:
    s = serve(POLICY.replace("TEXT", "before"), "--workers", "2")
    s.wait_workers(2)
    applied = 'triage_policy_reloads_total{outcome="applied"}'
    rejected = 'triage_policy_reloads_total{outcome="rejected"}'

    def wait_for(sample: str, n: float) -> None:
        deadline = time.monotonic() + 30
        while value(s.metrics(), sample) != n:
            assert time.monotonic() < deadline, s.metrics()
            time.sleep(0.2)

    s.policy.write_text(POLICY.replace("TEXT", "after"))
    wait_for(applied, 2)  # each worker watched the file and reloaded
    answers = spread(s.url, 16, 2)
    assert {r.json()["choices"][0]["message"]["content"] for r in answers} == {"after"} and len(by_worker(answers)) == 2
    s.proc.send_signal(signal.SIGHUP)  # to the parent: passed on to every worker
    wait_for(applied, 4)
    limited = f"""
keys:
  - {{name: alpha, sha256: "{hashlib.sha256(b"sk-a").hexdigest()}", limits: {{rpm: 10}}}}
"""
    s.policy.write_text(POLICY.replace("TEXT", "limited") + limited)  # limits in a memory store: refused
    wait_for(rejected, 2)
    assert value(s.metrics(), applied) == 4
    assert "policy_reload_rejected" in s.output() and "state.store: redis" in s.output()


def test_workers_zero_is_refused() -> None:
    out = subprocess.run(
        command(Path("unused.yaml"), free_port(), "--workers", "0"), capture_output=True, text=True, timeout=60
    )
    said = " ".join(out.stderr.replace("│", " ").split())  # typer's box, unwrapped
    assert out.returncode == 2, said
    assert "Invalid value for '--workers'" in said and "greater than or equal to 1" in said, said


def test_keys_with_limits_in_a_memory_store_refuse_several_workers(tmp_path: Path) -> None:
    policy = tmp_path / "limited.yaml"
    key = hashlib.sha256(b"sk-a").hexdigest()
    policy.write_text(
        POLICY.replace("TEXT", "x") + f'keys:\n  - {{name: alpha, sha256: "{key}", limits: {{budget_per_day: 1}}}}\n'
    )
    out = subprocess.run(command(policy, free_port(), "--workers", "2"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "keys alpha have limits" in out.stderr and "state.store: redis" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_admin_api_on_a_memory_store_refuses_several_workers(tmp_path: Path) -> None:
    policy = tmp_path / "admin.yaml"
    policy.write_text(
        POLICY.replace("TEXT", "x") + f'access: {{admin_key: "{hashlib.sha256(b"sk-adm").hexdigest()}"}}\n'
    )
    out = subprocess.run(command(policy, free_port(), "--workers", "2"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "access.admin_key" in out.stderr and "state.store: redis" in out.stderr


def test_a_worker_that_cannot_start_stops_the_server(tmp_path: Path) -> None:
    """The parent validates the policy; a worker then fails to open the state store: exit 3, not a loop."""
    policy = tmp_path / "nostore.yaml"
    policy.write_text(
        POLICY.replace("TEXT", "x") + f'state: {{store: redis, url: "redis://127.0.0.1:{free_port()}/0"}}\n'
    )
    out = subprocess.run(
        command(policy, free_port(), "--workers", "2", "--no-watch"), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 3, out.stderr[-2000:]
    assert "worker_start_failed" in out.stderr + out.stdout


def test_the_sqlite_batch_api_is_served_by_one_worker_and_503_elsewhere(serve: Callable[..., Served]) -> None:
    s = serve(POLICY.replace("TEXT", "x") + "batches: {dir: batches}\n", "--workers", "2", "--no-watch")
    s.wait_workers(2)
    statuses: Counter[int] = Counter()
    for _ in range(30):
        r = httpx.get(s.url + "/v1/batches", timeout=10)  # a new connection each: either worker
        statuses[r.status_code] += 1
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "not_ready"
    assert set(statuses) <= {200, 503} and statuses[200] > 0, statuses
    assert s.output().count("batches_unavailable") == 1  # the other worker: one warning, naming why


def test_workers_stop_when_their_parent_is_killed(serve: Callable[..., Served]) -> None:
    s = serve(POLICY.replace("TEXT", "x"), "--workers", "2", "--no-watch")
    pids = [int(p) for p in s.wait_workers(2)]
    s.proc.kill()  # no chance to stop them: they must not hold the port alone
    s.proc.wait(10)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if alive(p)]
        time.sleep(0.2)
    assert "worker_orphaned" in s.output()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_port_in_use_is_refused_at_once(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY.replace("TEXT", "x"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(command(policy, port, "--workers", "2"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "bind_failed" in out.stdout + out.stderr and "in use" in out.stdout + out.stderr


def test_the_postgresql_batch_api_is_served_by_every_worker(
    serve: Callable[..., Served], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """With ``state.database`` every worker opens the store and runs a runner (as several gateways
    do): no 503, and a batch made through one connection completes, read through others."""
    dsn = request.getfixturevalue("database")  # a fresh database on tests.batch.test_fleet_batches' server
    text = fleet_policy(dsn, tmp_path / "shared-batches", latency=0.01)
    s = serve(text, "--workers", "2", "--no-watch")
    s.wait_workers(2)
    statuses = Counter(httpx.get(s.url + "/v1/batches", timeout=10).status_code for _ in range(20))
    assert statuses == Counter({200: 20}), statuses
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    lines = "\n".join(line(f"q{i}", f"question {i}", model="m") for i in range(12)).encode()
    upload = client.files.create(file=("in.jsonl", lines), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(client, batch.id, timeout=60)
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 12
    assert sorted(r["custom_id"] for r in jsonl(client, done.output_file_id)) == sorted(f"q{i}" for i in range(12))
    client.close()


SAMPLER = """
import os, sys
from types import SimpleNamespace as NS
from gateway.obs.metrics import Metrics
m = Metrics()
assert m.shared_dir == os.environ["PROMETHEUS_MULTIPROC_DIR"]
waiting, budget = int(sys.argv[1]), sys.argv[2] == "budget"
replica = NS(state=NS(api_base="http://r1"), in_flight=waiting + 1)
room = NS(waiting=waiting, replicas=[replica])
m.watch_backends(lambda: [("pool", NS(admission=room)), ("plain", NS())])
m.watch_budget(lambda: NS(offset=0.25, target=0.1, share=None) if budget else None)
m.in_flight.inc(waiting)
m.sample()
sys.stdout.write(m.render().decode())
"""


def test_live_gauges_are_sampled_into_shared_ones(tmp_path: Path) -> None:
    """Two processes' admission rooms are summed, the budget is one series per process (only where
    there is one), and each process's requests in flight add up: what /metrics shows under workers."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    run = [
        subprocess.run([sys.executable, "-c", SAMPLER, str(w), b], env=env, capture_output=True, text=True)
        for w, b in ((2, "budget"), (3, "none"))
    ]
    assert all(r.returncode == 0 for r in run), [r.stderr for r in run]
    text = run[1].stdout  # the second process renders both (the first one's files stay: it never died here)
    assert value(text, 'triage_admission_waiting{backend="pool"}') == 5
    assert value(text, 'triage_admission_in_flight{backend="pool",replica="http://r1"}') == 7
    assert value(text, "triage_in_flight_requests") == 5
    assert len(re.findall(r'^triage_cascade_threshold_offset\{pid="\d+"\} 0.25$', text, re.M)) == 1
    assert "triage_cascade_escalated_share" not in text and 'backend="plain"' not in text
