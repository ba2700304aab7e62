"""One structured log event per request, Prometheus metrics, no prompt text unless asked."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest
import structlog

from tests.conftest import Gateway

POLICY = """version: 1
backends: {script: {type: scripted, text: "hello there"}}
models: {scripted: {backend: script}}
logging: {log_prompts: LOG}
"""
SECRET = "my secret prompt text"


def request_events(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e.get("event") == "request"]


def test_one_event_per_request_without_prompt_text(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(POLICY.replace("LOG", "false"))
    client = gw.client()
    with structlog.testing.capture_logs() as logs:
        client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": SECRET}], extra_headers={"x-request-id": "req-1"}
        )
        list(
            client.chat.completions.create(
                model="scripted",
                messages=[{"role": "user", "content": SECRET}],
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": SECRET}])
    events = request_events(logs)
    assert len(events) == 3
    plain, streamed, missing = events
    assert plain["request_id"] == "req-1"
    assert plain["status"] == 200 and plain["served_model"] == "scripted" and plain["backend"] == "script"
    assert plain["attempts"][0]["outcome"] == "ok"
    assert plain["prompt_tokens"] == 4 and plain["completion_tokens"] == 2
    assert streamed["stream"] is True and streamed["completion_tokens"] == 2
    assert missing["status"] == 404 and missing["error"]["code"] == "model_not_found"
    assert SECRET not in repr(logs)


def test_prompts_are_logged_only_when_the_policy_says_so(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(POLICY.replace("LOG", "true"))
    with structlog.testing.capture_logs() as logs:
        gw.client().chat.completions.create(model="scripted", messages=[{"role": "user", "content": SECRET}])
    assert SECRET in repr(request_events(logs))


def test_metrics_count_requests_errors_latency_and_attempts(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(POLICY.replace("LOG", "false"))
    client = gw.client()
    client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    with gw.http() as http:
        http.post("/v1/chat/completions", content=b"{nope")
        text = http.get("/metrics").text
    assert 'triage_requests_total{endpoint="chat",model="scripted",status="200"} 1.0' in text
    assert 'triage_requests_total{endpoint="chat",model="-",status="400"} 1.0' in text
    assert 'triage_errors_total{status="400",type="invalid_request_error"} 1.0' in text
    assert 'triage_request_latency_seconds_count{endpoint="chat",model="scripted"} 1.0' in text
    assert 'triage_upstream_attempts_total{backend="script",outcome="ok",replica="scripted"} 1.0' in text
    assert 'triage_tokens_total{kind="completion",model="scripted"} 2.0' in text
