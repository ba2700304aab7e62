"""A request that crashed an engine is not sent into another crash (issue 51, item 3): its
fingerprint is refused for a while, a key that keeps crashing engines is slowed, and the requests
and batch lines queued behind crashes survive any number of them. The crashes are real: SIGSEGV
sent to a real SmolLM2 worker while it runs the request (``tests.backends.test_engines``' way), under a real
uvicorn, asked by the official client, and one of llama.cpp's own (a grammar it cannot parse, sent
past the gateway's check) for what the crash log shows. The guard's own rules are checked on a
fake clock first."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import structlog

from backends import crash_guard
from backends.crash_guard import Caller, CrashGuard, Suspect
from policies.errors import CrashCooldown, CrashingRequest, EngineCrashed
from tests import lanes
from tests.backends.test_engines import (
    COUNTING,
    POLICY,
    QUESTION,
    back_up,
    batch_through_kills,
    host_of,
    kill_when_running,
    running,
    wait_for,
)
from tests.conftest import Gateway, GatewayRunner

# --- the guard's rules, on a fake clock ----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def suspect(fp: str, caller: Caller | None = None) -> Suspect:
    return Suspect(lambda: fp, caller)


def admit(guard: CrashGuard, fp: str, caller: Caller | None = None) -> None:
    with crash_guard.calling(caller):
        guard.admit("m.gguf", lambda: fp)


def test_a_request_that_crashed_alone_is_refused_until_its_time_is_up() -> None:
    clock = Clock()
    guard = CrashGuard(clock=clock)
    admit(guard, "a")
    guard.crashed("m.gguf", [suspect("a")])
    with pytest.raises(CrashingRequest) as info:
        admit(guard, "a")
    assert info.value.status == 400 and info.value.body()["error"]["code"] == "request_crashed_engine"
    admit(guard, "b")  # another request is not refused
    clock.now += crash_guard.REQUEST_TTL_S + 1
    admit(guard, "a")  # forgotten


def test_two_requests_running_at_one_crash_share_the_blame() -> None:
    """A chat and a scorer context on one file: either may have crashed it. Each is let through
    once more; one that is running at a second crash is refused."""
    guard = CrashGuard(clock=Clock())
    guard.crashed("m.gguf", [suspect("a"), suspect("b")])
    admit(guard, "a")
    admit(guard, "b")
    guard.crashed("m.gguf", [suspect("a")])
    with pytest.raises(CrashingRequest):
        admit(guard, "a")
    admit(guard, "b")


def test_a_key_that_keeps_crashing_engines_cools_down() -> None:
    clock = Clock()
    guard = CrashGuard(clock=clock)
    bad, good = Caller("bad", "1" * 64), Caller("good", "2" * 64)
    with structlog.testing.capture_logs() as logs:
        for i in range(int(crash_guard.KEY_CRASHES)):
            admit(guard, f"r{i}", bad)  # each time a different request: no fingerprint stops it
            guard.crashed("m.gguf", [suspect(f"r{i}", bad)])
            clock.now += 1
    with pytest.raises(CrashCooldown) as info:
        admit(guard, "new", bad)
    assert info.value.status == 429 and info.value.body()["error"]["code"] == "engine_crash_cooldown"
    assert 0 < info.value.retry_after <= crash_guard.KEY_COOLDOWN_S
    admit(guard, "new", good)
    admit(guard, "new")  # no key
    assert [e["key"] for e in logs if e["event"] == "engine_key_cooldown"] == ["bad"]
    clock.now += crash_guard.KEY_COOLDOWN_S
    admit(guard, "new", bad)


def test_crashes_spread_wider_than_the_window_do_not_cool_a_key_down() -> None:
    clock = Clock()
    guard = CrashGuard(clock=clock)
    key = Caller("k", "3" * 64)
    for i in range(int(crash_guard.KEY_CRASHES) * 2):
        guard.crashed("m.gguf", [suspect(f"r{i}", key)])
        clock.now += crash_guard.KEY_WINDOW_S / (crash_guard.KEY_CRASHES - 1) + 1
    admit(guard, "new", key)


def test_nothing_is_hashed_while_nothing_crashed() -> None:
    def never() -> str:
        raise AssertionError("hashed")

    CrashGuard().admit("m.gguf", never)


def test_the_fingerprint_is_the_content_not_the_sampling() -> None:
    fp = crash_guard.fingerprint
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}
    same = fp("chat", "chat", {**body, "temperature": 0.7, "seed": 3, "max_tokens": 9, "model": "x"})
    assert fp("chat", "chat", body) == same
    assert fp("chat", "chat", {**body, "messages": [{"role": "user", "content": "hi!"}]}) != same
    assert fp("chat", "completion", body) != same and fp("scorer", "chat", body) != same


def test_crash_logs_show_no_request_content_unless_prompts_may_be_logged() -> None:
    grammar = 'root ::= "secret request text"'
    tail = ["llama_grammar_parser: " + grammar, "ggml.c:1234: GGML_ASSERT(n_dims <= 4) failed"]
    quiet = CrashGuard().stderr(tail)
    assert "secret" not in json.dumps(quiet)
    assert quiet == {"stderr": ["ggml.c:1234: GGML_ASSERT(n_dims <= 4) failed"], "stderr_lines": 2}
    assert CrashGuard(log_content=True).stderr(tail) == {"stderr": tail}


# --- real crashes of a real worker ---------------------------------------------------------------------------

KEYS = {name: f"{name}-key" for name in ("retrier", "crasher", "bystander", "culprit", "patient", "pair")}
KEYED = (
    POLICY
    + "keys:\n"
    + "".join(
        f"  - {{name: {name}, sha256: {hashlib.sha256(secret.encode()).hexdigest()}}}\n"
        for name, secret in KEYS.items()
    )
)


@pytest.fixture(scope="module")
@lanes.engine
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    runner = GatewayRunner(tmp_path_factory.mktemp("crashes"))
    yield runner.start(KEYED)
    runner.stop_all()


def crash(gw: Gateway, ask: Any) -> openai.APIStatusError:
    """``ask()`` in a thread, the worker killed (SIGSEGV) while it runs; its error once the
    worker is back."""
    host = host_of(gw)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(ask)
        pid = kill_when_running(host)
        with pytest.raises(openai.APIStatusError) as info:
            fut.result(120)
    back_up(gw, pid)
    return info.value


def long_completion(client: openai.OpenAI, prompt: str, **extra: Any) -> Any:
    return client.completions.create(model="smollm2", prompt=prompt, **({"max_tokens": 900, "temperature": 0} | extra))


def test_the_request_that_crashed_the_engine_is_refused_not_sent_again(keyed: Gateway) -> None:
    client, host = keyed.client(KEYS["retrier"]), host_of(keyed)
    prompt = COUNTING + " 101,"
    error = crash(keyed, lambda: long_completion(client, prompt))
    assert error.status_code == 502 and isinstance(error.body, dict) and error.body["code"] == "engine_crashed"
    pid, restarts = host.pid, host.restarts
    with structlog.testing.capture_logs() as logs:
        for extra in ({}, {"temperature": 0.9, "seed": 7}):  # a retry, and one at another temperature
            with pytest.raises(openai.BadRequestError) as info:
                long_completion(client, prompt, **extra)
            body = info.value.body
            assert isinstance(body, dict) and body["code"] == "request_crashed_engine", body
            assert "crashed" in body["message"] and body["type"] == "invalid_request_error"
    refused = [e for e in logs if e["event"] == "engine_request_refused"]
    assert len(refused) == 2 and refused[0]["reason"] == "crashed_engine" and refused[0]["key"] == "retrier"
    assert prompt not in json.dumps(refused, default=str)
    assert host.pid == pid and host.restarts == restarts  # never reached the engine
    # the same words streamed are the same request; other words are served
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=900, stream=True)
    assert client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=4).choices[0].text is not None


def test_a_key_that_keeps_crashing_engines_gets_429s_and_other_keys_are_served(
    keyed: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(crash_guard, "KEY_CRASHES", 2.0)
    crasher, bystander = keyed.client(KEYS["crasher"]), keyed.client(KEYS["bystander"])
    with structlog.testing.capture_logs() as logs:
        for i in range(2):  # a different request each time: the fingerprints do not stop them
            error = crash(keyed, lambda i=i: long_completion(crasher, f"{COUNTING} {200 + i},"))
            assert error.status_code == 502
        with pytest.raises(openai.RateLimitError) as info:
            crasher.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "engine_crash_cooldown", body
    retry_after = int(info.value.response.headers["retry-after"])
    assert 0 < retry_after <= crash_guard.KEY_COOLDOWN_S
    assert [e["key"] for e in logs if e["event"] == "engine_key_cooldown"] == ["crasher"]
    crashed = [e for e in logs if e["event"] == "engine_crashed"]
    assert len(crashed) == 2 and all("stderr_lines" in e for e in crashed)  # log_prompts is off
    reply = bystander.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert reply.choices[0].message.content is not None


def test_requests_queued_behind_three_crashes_are_all_answered(keyed: Gateway) -> None:
    """Three requests that crash the worker in turn (each killed while it runs), four innocent
    ones queued behind them from the start: the innocent ones are sent to each next worker until
    one runs them, and all four are answered (they used to be sent again once, then failed)."""
    culprit, patient, host = keyed.client(KEYS["culprit"]), keyed.client(KEYS["patient"]), host_of(keyed)
    culprits = [f"{COUNTING} {300 + i}," for i in range(3)]
    innocent = [f"Say {i}." for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        bad = []
        for n, prompt in enumerate(culprits, start=1):  # in this order in the worker's queue
            bad.append(pool.submit(long_completion, culprit, prompt))
            wait_for(lambda n=n: len(host._jobs) == n, what="the job queued")
        good = []
        for n, prompt in enumerate(innocent, start=len(culprits) + 1):
            good.append(
                pool.submit(
                    patient.chat.completions.create,
                    model="smollm2",
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=4,
                )
            )
            wait_for(lambda n=n: len(host._jobs) == n, what="the job queued")
        for _ in culprits:
            pid = kill_when_running(host)
            wait_for(lambda pid=pid: host.pid not in (None, pid), what="the next worker")
        for f in bad:
            with pytest.raises(openai.InternalServerError, match="crashed"):
                f.result(120)
        answers = [f.result(120).choices[0].message.content for f in good]
    assert all(a is not None for a in answers), answers


def test_two_requests_running_side_by_side_at_a_crash_are_each_run_again_alone(keyed: Gateway) -> None:
    """A chat completion and a decision (the scorer's context on the same file) both running when
    the worker dies: either may have crashed it, so each runs again in the next worker with
    nothing beside it, and both are answered (the innocent one used to fail with the culprit)."""
    client, host = keyed.client(KEYS["pair"]), host_of(keyed)
    with keyed.http() as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
        chat = pool.submit(long_completion, client, f"{COUNTING} 500,", max_tokens=300)
        wait_for(lambda: running(host), what="the completion to start")
        decision = pool.submit(
            http.post, "/v1/decide", json=QUESTION, headers={"Authorization": f"Bearer {KEYS['pair']}"}
        )
        wait_for(lambda: sum(j.started for j in list(host._jobs.values())) == 2, what="both to run")
        pid = host.pid
        assert pid is not None
        os.kill(pid, signal.SIGSEGV)
        assert chat.result(120).choices[0].text
        answered = decision.result(120)
    assert answered.status_code == 200, answered.text
    assert answered.json()["answer"] in QUESTION["options"]
    assert host.pid != pid


@pytest.mark.engine
def test_a_batch_with_two_crashing_lines_answers_every_other_line(tmp_path: Path) -> None:
    """Two lines kill the worker (killed while each runs), the lines queued behind them survive
    both crashes: 2 error lines, 4 answers (the issue's batch lost 2 innocent lines)."""
    errors, out = batch_through_kills(tmp_path, 2)
    assert len(errors) == 2 and len(out) == 4, (errors, out)
    assert all(e["response"]["body"]["error"]["code"] == "engine_crashed" for e in errors), errors


def engine_job(gw: Gateway, args: dict[str, Any]) -> Any:
    """A chat job sent straight to the gateway's engine (past the gateway's schema check: what
    the engine does with a request that still crashes it), on the gateway's own loop."""
    host = host_of(gw)
    loop = next(iter(host._tasks)).get_loop()
    eid = next(e for e, spec in host.specs.items() if spec.kind == "chat")
    return asyncio.run_coroutine_threadsafe(host.call(eid, "chat", args, 60), loop).result(60)


# llama.cpp cannot repeat a rule 10,000 times: it prints the grammar (the request's schema) and dies
GRAMMAR_CRASH = {
    "messages": [{"role": "user", "content": "Write it."}],
    "max_tokens": 4,
    "response_format": {"type": "json_object", "schema": {"type": "string", "maxLength": 10000}},
}


@pytest.mark.engine
@pytest.mark.parametrize("log_prompts", [False, True])
def test_a_real_crash_logs_the_grammar_only_where_prompts_may_be_logged(tmp_path: Path, log_prompts: bool) -> None:
    runner = GatewayRunner(tmp_path)
    gw = runner.start(POLICY + f"logging: {{log_prompts: {str(log_prompts).lower()}}}\n")
    try:
        pid = host_of(gw).pid
        assert pid is not None
        with structlog.testing.capture_logs() as logs, pytest.raises(EngineCrashed):
            engine_job(gw, GRAMMAR_CRASH)
        back_up(gw, pid)
    finally:
        runner.stop_all()
    (event,) = [e for e in logs if e["event"] == "engine_crashed"]
    grammar = [line for line in event["stderr"] if "::=" in line]  # llama.cpp prints the rules it was given
    if log_prompts:
        assert grammar, event
    else:
        assert not grammar and event["stderr_lines"] > 0, event
        assert "maxLength" not in json.dumps(event, default=str) and "char ::=" not in json.dumps(event, default=str)
