"""Every error status, OpenAI-shaped, through the official client and raw HTTP; the server
keeps serving after each."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

import httpx
import openai
import orjson
import pytest
import structlog

from tests.conftest import Gateway

KEY = "sk-test-key-123"
SCRIPTED = """version: 1
backends:
  script:
    type: scripted
    text: "one two three four five six"
    chunks: 3
  slow:
    type: scripted
    latency_s: 0.6
  stuck:
    type: scripted
    latency_s: 5
    timeouts: {first_byte_s: 0.2}
  broken:
    type: scripted
    fail_first: 1000
  dying:
    type: scripted
    text: "a b c d e f"
    chunks: 6
    die_after_chunks: 2
models:
  scripted: {backend: script}
  slow: {backend: slow}
  stuck: {backend: stuck}
  broken: {backend: broken}
  dying: {backend: dying}
limits:
  max_body_bytes: 4096
  max_concurrency: 2
"""
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture
def gw(gateway: Callable[..., Gateway]) -> Gateway:
    return gateway(SCRIPTED)


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def still_serving(gw: Gateway) -> None:
    out = gw.client().chat.completions.create(model="scripted", messages=MSG)
    assert out.choices[0].message.content == "one two three four five six"


def test_malformed_json_is_400(gw: Gateway) -> None:
    with gw.http() as http:
        resp = http.post(
            "/v1/chat/completions",
            content=b'{"model": "scripted", "messages": [',
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 400
        assert error_of(resp)["code"] == "invalid_json"
        resp = http.post("/v1/chat/completions", content=b"[1, 2]")
        assert resp.status_code == 400
    still_serving(gw)


def test_invalid_fields_are_400_naming_the_param(gw: Gateway) -> None:
    client = gw.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="scripted", messages=MSG, temperature=7)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="scripted", messages=[])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="scripted", prompt="x", logprobs=99)
    still_serving(gw)


def test_unknown_model_is_404(gw: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        gw.client().chat.completions.create(model="gpt-17", messages=MSG)
    assert info.value.body["code"] == "model_not_found"
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        gw.client().models.retrieve("gpt-17")
    with gw.http() as http:
        assert error_of(http.get("/v2/nothing"))["code"] == "not_found"
    still_serving(gw)


def test_oversized_body_is_413(gw: Gateway) -> None:
    big = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(openai.APIStatusError) as info:
        gw.client().chat.completions.create(model="scripted", messages=big)
    assert info.value.status_code == 413
    with gw.http() as http:  # no content-length: chunked upload, counted as it arrives
        resp = http.post("/v1/chat/completions", content=iter([b'{"model": "scripted", ', b" " * 5000]))
        assert resp.status_code == 413
        assert error_of(resp)["code"] == "payload_too_large"
    still_serving(gw)


def test_concurrency_limit_is_429(gw: Gateway) -> None:
    results: list[int] = []

    def slow_call() -> None:
        with gw.http() as http:
            results.append(http.post("/v1/chat/completions", json={"model": "slow", "messages": MSG}).status_code)

    threads = [threading.Thread(target=slow_call) for _ in range(2)]
    for t in threads:
        t.start()
    with gw.http() as http:  # both slots are taken while the two slow calls wait
        for _ in range(100):
            if http.get("/metrics").text.count("triage_in_flight_requests 2.0"):
                break
            threading.Event().wait(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            gw.client().chat.completions.create(model="scripted", messages=MSG)
    assert info.value.response.headers["retry-after"] == "1"
    for t in threads:
        t.join()
    assert results == [200, 200]
    still_serving(gw)


def test_upstream_failure_is_502(gw: Gateway) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        gw.client().chat.completions.create(model="broken", messages=MSG)
    assert info.value.status_code == 502
    assert info.value.body["type"] == "upstream_error"
    still_serving(gw)


def test_upstream_timeout_is_504(gw: Gateway) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        gw.client().chat.completions.create(model="stuck", messages=MSG)
    assert info.value.status_code == 504
    assert info.value.body["code"] == "upstream_timeout"
    with pytest.raises(openai.InternalServerError) as info:  # a stream that never starts: a 504 too
        gw.client().chat.completions.create(model="stuck", messages=MSG, stream=True)
    assert info.value.status_code == 504
    still_serving(gw)


def test_stream_cut_midway_ends_with_an_error_event(gw: Gateway) -> None:
    got: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in gw.client().chat.completions.create(model="dying", messages=MSG, stream=True):
            got.append(chunk.choices[0].delta.content or "")
    assert "".join(got) == "a b "
    assert "died after 2 chunks" in str(info.value)
    # on the wire: two chunks, an error event, then a clean [DONE]
    body = {"model": "dying", "messages": MSG, "stream": True}
    with gw.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = orjson.loads(events[-2])["error"]
    assert err["type"] == "upstream_error" and "died" in err["message"]
    assert len(events) == 4
    still_serving(gw)


def test_api_keys_are_checked_against_hashes(gateway: Callable[..., Gateway], monkeypatch: pytest.MonkeyPatch) -> None:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    monkeypatch.setenv("TEST_KEY_SHA", hashlib.sha256(b"sk-other").hexdigest())
    keys = f"keys:\n  - {{name: a, sha256: '{digest}'}}\n  - {{name: b, sha256: 'env:TEST_KEY_SHA'}}\n"
    gw = gateway(SCRIPTED + keys)
    with pytest.raises(openai.AuthenticationError) as info:
        gw.client(api_key="wrong").chat.completions.create(model="scripted", messages=MSG)
    assert info.value.body["code"] == "invalid_api_key"
    with gw.http() as http:
        assert http.get("/v1/models").status_code == 401
        assert http.post("/v1/completions", json={"model": "scripted", "prompt": "x"}).status_code == 401
        assert http.get("/health").status_code == 200  # liveness needs no key
    out = gw.client(api_key=KEY).chat.completions.create(model="scripted", messages=MSG)
    assert out.choices[0].finish_reason == "stop"
    assert gw.client(api_key="sk-other").completions.create(model="scripted", prompt="x").choices
    assert [m.id for m in gw.client(api_key=KEY).models.list()] == ["scripted", "slow", "stuck", "broken", "dying"]


def test_client_leaving_mid_stream_frees_its_slot(gateway: Callable[..., Gateway]) -> None:
    gw = gateway("""version: 1
backends: {slow: {type: scripted, text: "a b c d e f g h", chunks: 8, chunk_delay_s: 0.3}}
models: {slow: {backend: slow}}
limits: {max_concurrency: 1}
""")
    body = {"model": "slow", "messages": MSG, "stream": True}
    with structlog.testing.capture_logs() as logs:
        with gw.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
            next(resp.iter_lines())  # one event, then hang up
        for _ in range(100):  # the slot comes back without waiting for the stream's end
            if any(e.get("event") == "request" for e in logs):
                break
            threading.Event().wait(0.02)
    [event] = [e for e in logs if e.get("event") == "request"]
    assert event["status"] == 499
    assert event["latency_ms"] < 1500
    out = gw.client().chat.completions.create(model="slow", messages=MSG)
    assert out.choices[0].message.content == "a b c d e f g h"


def test_a_string_stream_flag_is_rejected_not_taken_as_true(gw: Gateway) -> None:
    with gw.http() as http:
        resp = http.post("/v1/chat/completions", json={"model": "scripted", "messages": MSG, "stream": "false"})
    assert resp.status_code == 400 and error_of(resp)["param"] == "stream"
