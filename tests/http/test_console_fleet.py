"""The console's recent traffic shared by a fleet (gateway/state/recent_redis.py, issue 54 item 6):
a request one gateway answered is on another's traffic and request pages, and still there after
the gateway that answered it restarts; a Redis that goes down fails no request (the console falls
back to the process's own ring) and the ring fills again once it is back. Real `triage serve`
processes and in-process uvicorn gateways, real Redis servers, the console's own JSON and pages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.http import console_auth
from tests.conftest import Gateway, free_port, wait_http
from tests.http.test_console import ADMIN, APP, PROMPT, policy

CHAT = {"model": "cheap", "messages": [{"role": "user", "content": PROMPT}]}


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(console_auth.SECRET_ENV, "console-fleet-secret")  # the processes started inherit it
    console_auth.secret.cache_clear()
    yield
    console_auth.secret.cache_clear()


def shared(url: str, prefix: str) -> str:
    return policy(extra=f"state: {{store: redis, url: '{url}', prefix: {prefix}}}")


def ask(base: str, request_id: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {APP}", "x-request-id": request_id}
    return httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=headers, timeout=30)


@contextmanager
def console(base: str) -> Iterator[httpx.Client]:
    """A console session on the gateway at ``base`` (the admin key's)."""
    with httpx.Client(base_url=base, timeout=30, follow_redirects=False) as http:
        r = http.post("/console/login", data={"key": ADMIN, "next": "/console"}, headers={"origin": base})
        assert r.status_code == 303, r.text
        yield http


def traffic_until(http: httpx.Client, done: Callable[[dict[str, Any]], bool], within_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while True:
        t = http.get("/console/api/traffic").json()
        if done(t):
            return t
        assert time.monotonic() < deadline, t
        time.sleep(0.1)


def ids(t: dict[str, Any]) -> list[str]:
    return [r["request_id"] for r in t["latest"]]


class Serve:
    """`triage serve` processes on one policy file, each stopped as a deployment would (SIGTERM)."""

    def __init__(self, tmp: Path, text: str) -> None:
        self.tmp = tmp
        self.path = tmp / "policy.yaml"
        self.path.write_text(text)
        self.procs: list[subprocess.Popen] = []

    def start(self) -> tuple[subprocess.Popen, str]:
        port = free_port()
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(self.path), "--port", str(port)]
        with (self.tmp / f"gateway-{port}.log").open("wb") as log:
            proc = subprocess.Popen([*cmd, "--no-watch"], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        wait_http(f"http://127.0.0.1:{port}/health", 120, proc)
        return proc, f"http://127.0.0.1:{port}"

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            proc.wait(20)


def test_a_request_shows_on_every_gateways_console_and_after_a_restart(redis_url: str, tmp_path: Path) -> None:
    serve = Serve(tmp_path, shared(redis_url, "t-recent"))
    try:
        (one, a), (_, b) = serve.start(), serve.start()
        assert ask(a, "fleet-1").status_code == 200
        with console(b) as http:
            t = traffic_until(http, lambda t: "fleet-1" in ids(t))
            assert t["scope"] == "fleet" and t["all"]["requests"] >= 1 and t["total_seen"] >= 1
            row = t["latest"][ids(t).index("fleet-1")]
            assert row["surface"] == "chat" and row["model"] == "cheap" and row["status"] == 200 and row["key"] == "app"
            assert row["served"] and row["latency_ms"] > 0 and row["cost"] is not None
            page = http.get("/console/requests")
            assert (
                page.status_code == 200 and "fleet-1" in page.text and "Every gateway sharing this state" in page.text
            )
            trace = http.get("/console/requests/fleet-1")  # answered by the other gateway: its summary
            assert trace.status_code == 200 and "summary from the fleet" in trace.text and PROMPT not in trace.text
        one.terminate()
        one.wait(20)
        _, again = serve.start()  # the same gateway, restarted: an empty ring of its own
        with console(again) as http:
            assert "fleet-1" in ids(http.get("/console/api/traffic").json())
            assert http.get("/console/requests/fleet-1").status_code == 200
    finally:
        serve.stop_all()
    kept = redis.Redis.from_url(redis_url)
    try:
        assert all(PROMPT.encode() not in item for item in kept.lrange("t-recent:recent", 0, -1))  # prompts not logged
    finally:
        kept.close()


def start_redis(port: int, tmp: Path) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed: apt-get install redis-server (make test does)")
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        for _ in range(200):
            try:
                client.ping()
                return proc
            except redis.ConnectionError:
                time.sleep(0.05)
    finally:
        client.close()
    raise RuntimeError("redis-server did not answer")


def test_redis_down_fails_no_request_and_the_ring_fills_again_once_back(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    port = free_port()
    server = start_redis(port, tmp_path)
    try:
        gw = gateway(shared(f"redis://127.0.0.1:{port}/0", "t-down"))
        assert ask(gw.base_url, "before-1").status_code == 200
        with console(gw.base_url) as http:
            traffic_until(http, lambda t: t["scope"] == "fleet" and "before-1" in ids(t))
            server.terminate()
            server.wait(10)
            answered = [ask(gw.base_url, f"down-{i}").status_code for i in range(5)]
            assert answered == [200] * 5
            t = http.get("/console/api/traffic").json()  # the process's own ring meanwhile
            assert t["scope"] == "process" and {"down-0", "down-4"} <= set(ids(t))
            feed = gw.app.state.triage.holder.current.recent  # type: ignore[attr-defined]
            deadline = time.monotonic() + 10
            while feed.failed < 5:  # each summary that could not be written is counted
                assert time.monotonic() < deadline, feed.failed
                time.sleep(0.05)
            server = start_redis(port, tmp_path)
            deadline = time.monotonic() + 10
            while True:  # each is answered; the ring fills again
                assert ask(gw.base_url, "back-1").status_code == 200
                t = http.get("/console/api/traffic").json()
                if t["scope"] == "fleet" and "back-1" in ids(t):
                    break
                assert time.monotonic() < deadline, t
                time.sleep(0.2)
            assert feed.written >= 2 and "down-0" not in ids(t)  # what the outage dropped stays out
    finally:
        server.terminate()
        server.wait(10)
