"""Hot reload of a good and of a bad policy, by SIGHUP and by a change of the file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import Gateway, free_port, wait_http

ONE = """version: 1
backends: {script: {type: scripted, text: first}}
models: {alpha: {backend: script}}
"""
TWO = """version: 1
backends: {script: {type: scripted, text: second}}
models:
  alpha: {backend: script}
  beta: {backend: script}
"""
BAD = """version: 1
backends: {script: {type: scripted}}
models:
  alpha: {backend: nowhere}
"""


def models(base: str) -> list[str]:
    return [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.fleet  # a gateway process of its own
def test_sighup_reloads_a_good_policy_and_keeps_the_old_on_a_bad_one(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(ONE)
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy), "--port", str(port), "--no-watch"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/health", 60, proc)
        assert models(base) == ["alpha"]
        policy.write_text(TWO)
        os.kill(proc.pid, signal.SIGHUP)
        assert wait_for(lambda: models(base) == ["alpha", "beta"])
        reply = httpx.post(
            base + "/v1/chat/completions", json={"model": "beta", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert reply.json()["choices"][0]["message"]["content"] == "second"

        policy.write_text(BAD)
        os.kill(proc.pid, signal.SIGHUP)
        assert wait_for(lambda: b"policy_reload_rejected" in log.read_bytes())
        assert models(base) == ["alpha", "beta"]  # the old policy keeps serving
        [event] = [orjson.loads(line) for line in log.read_bytes().splitlines() if b"policy_reload_rejected" in line]
        assert event["problems"] == [f"{policy}:4:11: models.alpha.backend: backend 'nowhere' is not defined"]
        assert httpx.get(base + "/health").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
    assert b'"event":"gateway_stopped"' in log.read_bytes()  # after a clean shutdown


def test_file_change_reloads(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(ONE, watch=True)
    assert models(gw.base_url) == ["alpha"]
    time.sleep(0.3)  # let the watcher start
    gw.policy_path.write_text(TWO)
    assert wait_for(lambda: models(gw.base_url) == ["alpha", "beta"])
    gw.policy_path.write_text(BAD)
    time.sleep(1.0)
    assert models(gw.base_url) == ["alpha", "beta"]
    with gw.http() as http:
        metrics = http.get("/metrics").text
    assert 'triage_policy_reloads_total{outcome="rejected"} 1.0' in metrics
    assert 'triage_policy_reloads_total{outcome="applied"} 1.0' in metrics
