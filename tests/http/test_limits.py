"""The limits a request meets before and around the API (issue 36): a real ``triage serve``
guards its connections (headers within ``limits.header_timeout_s``, at most
``limits.max_connections`` open), every body-reading route is bounded in size and time (the admin
API, multipart uploads), and the fields checked at the door (``logit_bias``, the embeddings' cap)."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from backends.remote import upstream_failure
from policies.errors import UpstreamRejected
from tests.conftest import Gateway
from tests.http.test_workers import Served, serve  # noqa: F401 (a fixture)

ADMIN, USER = "sk-admin-limits", "sk-user-limits"
AUTH = {"authorization": f"Bearer {USER}"}
POLICY = f"""version: 1
backends: {{script: {{type: scripted, text: "ok"}}}}
models: {{scripted: {{backend: script}}}}
limits: {{header_timeout_s: HEADER, max_connections: 20}}
access: {{admin_key: "{hashlib.sha256(ADMIN.encode()).hexdigest()}"}}
keys: [{{name: user, sha256: "{hashlib.sha256(USER.encode()).hexdigest()}"}}]
"""
BODY = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=15)


def answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the one answer on ``sock``, read until the server closes it."""
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_headers_must_arrive_in_time_on_every_request_of_a_connection(serve: Callable[..., Served]) -> None:  # noqa: F811
    s = serve(POLICY.replace("HEADER", "1"), "--no-watch")
    silent, partial, kept = connect(s.url), connect(s.url), connect(s.url)
    partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    body = json.dumps(BODY).encode()
    kept.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {USER}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    first = kept.recv(65536)
    assert first.startswith(b"HTTP/1.1 200"), first
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next request on it stalls in its headers
    started = time.monotonic()
    for sock in (silent, partial, kept):
        status, err = answer(sock)
        assert status == 408 and err["error"]["code"] == "request_timeout", err
    assert time.monotonic() - started < 10
    assert httpx.post(s.url + "/v1/chat/completions", json=BODY, headers=AUTH, timeout=10).status_code == 200
    assert "header_timeout" in s.output()


def test_connections_past_the_cap_get_503_and_the_server_serves_on(serve: Callable[..., Served]) -> None:  # noqa: F811
    s = serve(POLICY.replace("HEADER", "3"), "--no-watch")
    held = [connect(s.url) for _ in range(20)]  # they never send a byte
    time.sleep(0.3)
    extra = connect(s.url)
    status, err = answer(extra)
    assert status == 503 and err["error"]["code"] == "too_many_connections", err
    for sock in held:  # the header timeout frees them
        assert answer(sock)[0] == 408
    assert httpx.post(s.url + "/v1/chat/completions", json=BODY, headers=AUTH, timeout=10).status_code == 200
    assert "connection_refused" in s.output()


def test_admin_bodies_are_bounded_in_size_and_time(serve: Callable[..., Served]) -> None:  # noqa: F811
    s = serve(POLICY.replace("HEADER", "5"), "--no-watch")
    auth = {"authorization": f"Bearer {ADMIN}"}
    big = b'{"name": "' + b"x" * (128 * 1024) + b'"}'
    r = httpx.post(s.url + "/admin/keys", content=big, headers={**auth, "content-type": "application/json"}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text
    ok = httpx.post(s.url + "/admin/keys", json={"name": "fine"}, headers=auth, timeout=10)
    assert ok.status_code == 201, ok.text


@pytest.mark.parametrize("path", ["/admin/keys", "/v1/files"])
def test_a_stalled_body_is_a_408_on_admin_and_uploads(
    gateway: Callable[..., Gateway], path: str, tmp_path: Path
) -> None:
    policy = POLICY.replace("header_timeout_s: HEADER", "body_timeout_s: 1, header_timeout_s: 5")
    gw = gateway(policy + f'batches: {{dir: "{tmp_path / "b"}"}}\n')
    sock = connect(gw.base_url)
    admin = path.startswith("/admin")
    kind = "application/json" if admin else "multipart/form-data; boundary=b"
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN if admin else USER}\r\n"
        f"Content-Type: {kind}\r\nContent-Length: 1000\r\n\r\n".encode()
        + b"--b\r\n"
    )
    started = time.monotonic()
    status, err = answer(sock)
    assert status == 408 and err["error"]["code"] == "request_timeout", err
    assert time.monotonic() - started < 5
    with gw.http() as http:
        assert http.get("/health").status_code == 200


def test_fields_checked_at_the_door(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    gw = gateway(POLICY.replace("HEADER", "5") + f'batches: {{dir: "{tmp_path / "b"}"}}\n')
    with gw.http() as http:
        for limit in ("³", "0", "x"):  # "³".isdigit(), and int("³") raises: found by the fuzz suite
            r = http.get("/v1/batches", params={"limit": limit}, headers=AUTH)
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
        for bias, param in (([1, 2], "logit_bias"), ({"x": 1}, "logit_bias.x.[key]"), ({"5": 101}, "logit_bias.5")):
            r = http.post("/v1/chat/completions", json={**BODY, "logit_bias": bias}, headers=AUTH)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        for path in ("/admin/keys/", "/admin/keys//", "/v1/models/"):  # no redirect before any key is checked
            r = http.delete(path, headers=AUTH)
            assert r.status_code in (401, 404, 405) and "error" in r.json(), (path, r.status_code)
        ok = http.post("/v1/chat/completions", json={**BODY, "logit_bias": {"5": -100}}, headers=AUTH)
        assert ok.status_code == 200, ok.text


def test_the_upstream_words_reach_a_client_only_where_the_backend_says() -> None:
    words = "bad field at http://10.0.0.1:81 with Bearer sk-abcdefgh"
    generic = upstream_failure("pool", 422, words, "invalid_field")
    assert isinstance(generic, UpstreamRejected) and generic.status == 422 and generic.code == "invalid_field"
    assert generic.message == "upstream pool refused the request (HTTP 422)" and generic.detail == words
    scrubbed = upstream_failure("pool", 422, words, "Free text, not a code", text="scrubbed")
    assert scrubbed.message == "bad field at [redacted] with [redacted]" and scrubbed.code is None


def test_the_grammar_check_refuses_what_llama_cpp_cannot_parse() -> None:
    """Each refused grammar here crashed llama-cpp-python 0.3.36 (SIGSEGV: a failed parse, then
    sampling with no grammar), tried one by one on SmolLM2; each accepted one parsed and served."""
    from backends.schema_bounds import SchemaOutOfBounds, nesting

    for ok in ('root ::= "a\\-b"', "root ::= [a\\-z]+", 'root ::= "a\\tb"', "root ::= [\\]\\[]", 'root ::= "\\x41"'):
        assert nesting(ok) == 0, ok
    for bad in ("root ::= [a\\.z]+", 'root ::= "a\\/b"', 'root ::= "\\"\\\\"\\""', 'root ::= "a'):
        with pytest.raises(SchemaOutOfBounds):
            nesting(bad)


def test_an_answer_goes_out_in_one_write_and_nothing_is_lost_or_reordered() -> None:
    """The connection's transport (gateway.http.connections.Coalesced): uvicorn's two writes of an
    answer (head, then body) in one turn of the loop are one write; a lone write (a stream's chunk)
    goes out at the turn's end; closing sends what is held first; writes stay in order."""
    import asyncio

    from gateway.http.connections import Coalesced

    class Recorded:
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            assert not self.closed
            self.writes.append(bytes(data))

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

        def get_extra_info(self, name: str) -> str:
            return f"info:{name}"

    async def run() -> Recorded:
        t = Recorded()
        c = Coalesced(t, asyncio.get_running_loop())  # type: ignore[arg-type]
        c.write(b"HTTP/1.1 200 OK\r\n\r\n")
        c.write(b"body")
        assert t.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]  # joined at once, not at the turn's end
        c.write(b"chunk 1")
        assert t.writes[1:] == []  # held until the turn ends
        await asyncio.sleep(0)
        assert t.writes[1:] == [b"chunk 1"]
        c.write(b"a")
        c.write(bytearray(b"b"))
        c.write(b"c")
        await asyncio.sleep(0)
        assert b"".join(t.writes[2:]) == b"abc"
        c.write(b"last")
        c.close()  # what is held goes first
        assert t.writes[-1] == b"last" and t.closed
        await asyncio.sleep(0)  # the turn's flush finds nothing to send on a closed transport
        assert c.get_extra_info("peername") == "info:peername"  # the rest is the transport's own
        return t

    t = asyncio.run(run())
    assert b"".join(t.writes) == b"HTTP/1.1 200 OK\r\n\r\nbodychunk 1abclast"


def test_without_a_log_event_the_bookkeeping_runs_once_the_answer_is_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With request events off (level warning) a door's bookkeeping (the concurrency slot, metrics,
    the runtime pin) runs after the answer's last byte is sent, and still runs when sending fails;
    with events on, before the answer, as the tests that read log lines expect (doors.after_answer).
    A step that fails after the answer is logged and the gateway serves on."""
    import logging

    import structlog
    from starlette.testclient import TestClient

    from gateway.http.app import create_app
    from gateway.http.exchange import Exchange
    from gateway.http.settings import Settings
    from gateway.obs import logs

    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\nbackends:\n  say: {type: scripted, text: fine}\nmodels:\n  m: {backend: say}\n"
        "cascade:\n  tiers:\n    - {name: only, type: model, model: m, logprobs: false}\n"
    )
    app = create_app(Settings(policy_path=path, watch_policy=False, handle_sighup=False, configure_logging=False))
    seen: list[tuple[int, float]] = []  # at each body sent: requests in flight, requests counted
    fail = {"send": False}

    def counted() -> float:
        return app.state.triage.metrics.requests.labels("chat", "m", "200")._value.get()

    async def watched(scope: dict, receive: Callable, send: Callable) -> None:
        async def spy(message: dict) -> None:
            if message["type"] == "http.response.body":
                seen.append((app.state.triage.gate.in_flight, counted()))
                if fail["send"]:
                    raise OSError("the client's socket broke")
            await send(message)

        await app(scope, receive, spy if scope["type"] == "http" else send)

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(watched) as client:
        assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == "fine"
        assert seen == [(0, 1)]  # events on (the default): counted before the answer, as before
        monkeypatch.setattr(logs, "_level", logging.WARNING)
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert seen[1] == (1, 1) and app.state.triage.gate.in_flight == 0 and counted() == 2  # after the answer
        fail["send"] = True
        with pytest.raises(OSError):
            client.post("/v1/chat/completions", json=body)
        assert seen[2] == (1, 2) and app.state.triage.gate.in_flight == 0 and counted() == 3  # given back all the same
        fail["send"] = False
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert app.state.triage.gate.in_flight == 0 and counted() == 4

        def broken(*_: object) -> None:
            raise RuntimeError("a bug in the bookkeeping")

        with monkeypatch.context() as m, structlog.testing.capture_logs() as events:
            m.setattr(Exchange, "_report", broken)
            assert client.post("/v1/chat/completions", json=body).status_code == 200  # the answer was out
        assert [e["event"] for e in events] == ["bookkeeping_failed"] and app.state.triage.gate.in_flight == 0
        assert client.post("/v1/chat/completions", json=body).status_code == 200 and counted() == 5
