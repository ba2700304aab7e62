"""Replicas and fallbacks: a killed replica, a dead address, ejection, the fallback model."""

from __future__ import annotations

import threading
from collections.abc import Callable

import openai
import pytest

from tests.conftest import Gateway, LlamaServer, free_port
from tests.http.test_openai_surface import MSG, pool_policy


def attempts_metric(gw: Gateway) -> str:
    with gw.http() as http:
        return http.get("/metrics").text


def test_killed_replica_mid_run_sends_requests_to_the_other(
    gateway: Callable[..., Gateway], llama_server: LlamaServer, spare_llama_server: LlamaServer
) -> None:
    gw = gateway(pool_policy(llama_server.api_base, spare_llama_server.api_base))
    client = gw.client()
    statuses: list[str] = []

    def worker() -> None:
        for _ in range(6):
            out = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=4, temperature=0)
            statuses.append(out.choices[0].finish_reason)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    while len(statuses) < 3:
        threading.Event().wait(0.01)
    spare_llama_server.kill()  # in the middle of the run
    for t in threads:
        t.join()
    assert len(statuses) == 12  # every request answered
    metrics = attempts_metric(gw)
    assert f'replica="{spare_llama_server.api_base}"' in metrics
    with gw.http() as http:  # the dead replica is out, the backend still ready
        assert http.get("/ready").json()["status"] == "ready"


def test_dead_replica_is_ejected_after_one_failure(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    gw = gateway(pool_policy(dead, llama_server.api_base).replace("interval_s: 0.5", "enabled: false"))
    client = gw.client()
    for _ in range(4):
        assert client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=2).choices
    metrics = attempts_metric(gw)
    [line] = [x for x in metrics.splitlines() if x.startswith("triage_upstream_attempts_total") and dead in x]
    assert line.endswith(" 1.0")  # tried once, then ejected for the cool-down


def test_active_health_check_marks_a_dead_replica(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    gw = gateway(pool_policy(dead))
    with gw.http() as http:
        for _ in range(100):
            resp = http.get("/ready")
            if resp.status_code == 503:
                break
            threading.Event().wait(0.05)
        assert resp.status_code == 503
        assert resp.json() == {"status": "not_ready", "backends": {"pool": False}}


def test_fallback_model_answers_when_the_chain_fails(gateway: Callable[..., Gateway]) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    policy = f"""version: 1
backends:
  gone:
    type: openai
    replicas: [{{api_base: "{dead}"}}, {{api_base: "{dead.replace("/v1", "/x/v1")}"}}]
    retries: {{attempts: 2, backoff_s: 0.01}}
    health: {{enabled: false}}
  flaky: {{type: scripted, fail_first: 100}}
  spare: {{type: scripted, text: "from the fallback"}}
models:
  main: {{backend: gone, fallbacks: [second]}}
  second: {{backend: flaky}}
  last-resort: {{backend: spare}}
fallback_model: last-resort
"""
    gw = gateway(policy)
    raw = gw.client().chat.completions.with_raw_response.create(model="main", messages=MSG)
    assert raw.headers["x-triage-model"] == "last-resort"
    out = raw.parse()
    assert out.choices[0].message.content == "from the fallback"
    assert out.model == "last-resort"
    stream = gw.client().chat.completions.create(model="main", messages=MSG, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "from the fallback"


def test_upstream_5xx_is_retried_on_the_next_replica(
    gateway: Callable[..., Gateway], llama_server: LlamaServer
) -> None:
    # A real server that answers 502: another triage whose only model always fails.
    failing = gateway("""version: 1
backends: {broken: {type: scripted, fail_first: 1000}}
models: {smollm2: {backend: broken}}
""")
    gw = gateway(
        pool_policy(failing.base_url + "/v1", llama_server.api_base)
        .replace("interval_s: 0.5", "enabled: false")
        .replace("strategy", "x")
    )
    for _ in range(3):
        out = gw.client().chat.completions.create(model="smollm2", messages=MSG, max_tokens=2)
        assert out.choices
    metrics = attempts_metric(gw)
    bad = [x for x in metrics.splitlines() if x.startswith("triage_upstream_attempts_total") and failing.base_url in x]
    replica = f"{failing.base_url}/v1"
    assert bad == [f'triage_upstream_attempts_total{{backend="pool",outcome="error",replica="{replica}"}} 1.0']


def assert_a_kill_mid_stream_is_an_error_event(gw: Gateway, kill: Callable[[], None], max_tokens: int) -> None:
    """Streams a long answer through ``gw``, calls ``kill`` (the engine's end) after three chunks: the
    client gets an error event, and the gateway serves on."""
    stream = gw.client().chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Write a long story about a cat."}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    got = 0
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            got += 1
            if got == 3:
                kill()
    assert got >= 3
    assert "stream" in str(info.value)
    with gw.http() as http:
        assert http.get("/health").status_code == 200


def test_engine_killed_mid_stream_ends_with_an_error_event(
    gateway: Callable[..., Gateway], spare_llama_server: LlamaServer
) -> None:
    gw = gateway(pool_policy(spare_llama_server.api_base))
    assert_a_kill_mid_stream_is_an_error_event(gw, spare_llama_server.kill, max_tokens=400)


def test_prefix_affinity_sends_a_shared_prompt_start_to_one_replica(
    gateway: Callable[..., Gateway], llama_server: LlamaServer, spare_llama_server: LlamaServer
) -> None:
    policy = pool_policy(llama_server.api_base, spare_llama_server.api_base).replace(
        "    retries:", "    prefix_affinity_chars: 40\n    retries:"
    )
    gw = gateway(policy)
    client = gw.client()
    template = "You are a terse assistant. Answer in one word. Question number "
    for i in range(6):
        client.chat.completions.create(
            model="smollm2", max_tokens=1, messages=[{"role": "user", "content": f"{template}{i}?"}]
        )
    counts = [
        line
        for line in attempts_metric(gw).splitlines()
        if line.startswith("triage_upstream_attempts_total") and 'outcome="ok"' in line
    ]
    assert len(counts) == 1 and counts[0].endswith(" 6.0")  # one replica took them all
