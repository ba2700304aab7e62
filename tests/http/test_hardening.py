"""Hostile and broken inputs (issue 16): each is answered in the API's own error shape, logged, and
the server keeps serving. Official client and raw HTTP against a real uvicorn; upstreams are real
triage gateways, or a small fake engine where an upstream must misbehave."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.client
import io
import json
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from backends.base import Call, ChunkStream, Completion
from gateway.state.batches import BatchStore
from tests.batch.test_batches import jsonl, wait_batch
from tests.conftest import Gateway, free_port
from tests.http.test_errors import MSG, error_of

POLICY = """version: 1
backends:
  script: {type: scripted, text: "fine thanks", latency_s: LATENCY}
  echo: {type: scripted, echo: true}
  pool:
    type: openai
    replicas: [{api_base: "http://127.0.0.1:9/v1"}]
    health: {enabled: false}
    retries: {attempts: 1}
models:
  scripted: {backend: script}
  echo: {backend: echo}
  pool: {backend: pool}
virtual_models:
  auto: {type: cascade, open: scripted}
cascade:
  tiers:
    - {name: pool, type: model, model: scripted}
"""


def policy(latency: float = 0.0, extra: str = "") -> str:
    return POLICY.replace("LATENCY", str(latency)) + extra


def nested(depth: int) -> str:
    """JSON text of ``depth`` objects, one inside the other."""
    return '{"a":' * depth + "1" + "}" * depth


def chat(model: str, **fields: str) -> bytes:
    """A chat body with some fields given as raw JSON text."""
    extra = "".join(f', "{k}": {v}' for k, v in fields.items())
    return f'{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}]{extra}}}'.encode()


def still_serving(gw: Gateway) -> None:
    assert gw.client().chat.completions.create(model="scripted", messages=MSG).choices[0].message.content


# --- 1. deep JSON -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [130, 255, 300, 1000])
def test_json_nested_too_deep_is_a_400_in_any_field_and_the_server_keeps_serving(
    gateway: Callable[..., Gateway], depth: int
) -> None:
    gw = gateway(policy())
    deep = nested(depth)
    bodies = {
        "metadata": chat("echo", metadata=deep),
        "messages": f'{{"model": "pool", "messages": [{{"role": "user", "content": [{{"type": "text", '
        f'"text": "hi", "x": {deep}}}]}}]}}'.encode(),
        "tools": chat("pool", tools=f'[{{"type": "function", "function": {{"name": "f", "parameters": {deep}}}}}]'),
        "chat_template_kwargs": chat("echo", chat_template_kwargs=deep),
    }
    with structlog.testing.capture_logs() as logs, gw.http() as http:
        for field, body in bodies.items():
            resp = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 400, (field, resp.text)
            err = error_of(resp)
            assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "nested_too_deep", field)
        resp = http.post("/v1/completions", content=f'{{"model": "echo", "prompt": "x", "logit_bias": {deep}}}')
        assert resp.status_code == 400 and error_of(resp)["param"] == "logit_bias"
    events = [e for e in logs if e["event"] == "request"]
    assert len(events) == 5 and all(e["status"] == 400 and e["error"]["code"] == "nested_too_deep" for e in events)
    still_serving(gw)


def test_json_nested_within_the_limit_reaches_the_backend(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    with gw.http() as http:
        resp = http.post("/v1/chat/completions", content=chat("echo", metadata=nested(120)))
    assert resp.status_code == 200, resp.text
    echoed = json.loads(resp.json()["choices"][0]["message"]["content"])
    assert json.dumps(echoed["metadata"]).count("{") == 120


# --- 2. response_format.json_schema that is not an object -------------------------------------------------


@pytest.mark.parametrize(
    ("json_schema", "param"),
    [
        ('"x"', "response_format.json_schema"),
        ("5", "response_format.json_schema"),
        ("[]", "response_format.json_schema"),
        ("null", "response_format.json_schema"),
        ('{"name": "x", "schema": "x"}', "response_format.json_schema.schema"),
        ('{"name": "x", "schema": [1]}', "response_format.json_schema.schema"),
    ],
)
def test_a_json_schema_that_is_not_an_object_is_a_400_naming_it(
    gateway: Callable[..., Gateway], json_schema: str, param: str
) -> None:
    gw = gateway(policy())
    body = chat("auto", response_format=f'{{"type": "json_schema", "json_schema": {json_schema}}}')
    with gw.http() as http:
        resp = http.post("/v1/chat/completions", content=body)
    assert resp.status_code == 400, resp.text
    assert error_of(resp)["param"] == param
    still_serving(gw)


# --- 3. one bad line never loses a batch --------------------------------------------------------------------


class Exploding:
    """A fake backend: a real one that, for a prompt saying "explode", raises what a bug raises (not
    the gateway's own error type). Put in a running gateway's runtime in place of the real one."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name, self.capabilities = inner, inner.name, inner.capabilities

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def healthy(self) -> bool:
        return self.inner.healthy()

    def _check(self, call: Call) -> None:
        if "explode" in json.dumps(call.body.get("messages")):
            raise ZeroDivisionError("a bug in a backend")

    async def complete(self, call: Call) -> Completion:
        self._check(call)
        return await self.inner.complete(call)

    async def open_stream(self, call: Call) -> ChunkStream:
        self._check(call)
        return await self.inner.open_stream(call)


def explode_in(gw: Gateway, backend: str = "script") -> None:
    backends = gw.app.state.triage.holder.current.backends  # type: ignore[attr-defined]
    backends[backend] = Exploding(backends[backend])


def batch_line(cid: str, body: dict[str, Any] | str) -> str:
    text = body if isinstance(body, str) else json.dumps(body)
    return f'{{"custom_id": "{cid}", "method": "POST", "url": "/v1/chat/completions", "body": {text}}}'


def test_lines_that_raise_become_error_lines_and_the_batch_completes(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(latency=0.3, extra=f'batches: {{dir: "{tmp_path / "b"}", concurrency: 4}}\n'))
    explode_in(gw)
    client = gw.client()
    good = [
        batch_line(f"ok{i}", {"model": "scripted", "messages": [{"role": "user", "content": f"q{i}"}]})
        for i in range(10)
    ]
    bad = {
        "boom": batch_line("boom", {"model": "scripted", "messages": [{"role": "user", "content": "explode"}]}),
        "deep": batch_line("deep", json.loads(chat("scripted")) | {"metadata": "DEEP"}).replace('"DEEP"', nested(300)),
        "typed": batch_line(
            "typed", {"model": "auto", "messages": MSG, "response_format": {"type": "json_schema", "json_schema": "x"}}
        ),
    }
    lines = [*good[:1], bad["boom"], *good[1:5], bad["deep"], bad["typed"], *good[5:]]  # boom while 3 in flight
    f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    with structlog.testing.capture_logs() as logs:
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = wait_batch(client, batch.id, timeout=60)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (13, 10, 3)
    out, errors = jsonl(client, batch.output_file_id), jsonl(client, batch.error_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"ok{i}" for i in range(10))  # each once
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] == "fine thanks" for o in out)
    by_id = {e["custom_id"]: e for e in errors}
    assert sorted(by_id) == ["boom", "deep", "typed"] and len(errors) == 3
    assert by_id["boom"]["response"]["status_code"] == 500
    assert by_id["boom"]["error"]["code"] == "server_error" and "a bug" not in json.dumps(by_id["boom"])
    assert "nested more than" in by_id["deep"]["error"]["message"]
    assert by_id["typed"]["response"]["status_code"] == 400
    assert by_id["typed"]["response"]["body"]["error"]["param"] == "response_format.json_schema"
    [event] = [e for e in logs if e["event"] == "batch_request_failed"]
    assert event["batch_id"] == batch.id and event["exc_info"]


# --- 4. batch data belongs to its key -----------------------------------------------------------------------


def keys(*names: str) -> str:
    return "keys:\n" + "".join(
        f"  - {{name: {n}, sha256: '{hashlib.sha256(n.encode()).hexdigest()}'}}\n" for n in names
    )


def test_a_key_cannot_see_or_touch_another_keys_files_and_batches(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(
        policy(
            latency=0.2, extra=f'batches: {{dir: "{tmp_path / "b"}", concurrency: 1}}\n' + keys("sk-alice", "sk-bob")
        )
    )
    alice, bob = gw.client("sk-alice"), gw.client("sk-bob")
    data = "\n".join(batch_line(f"c{i}", {"model": "scripted", "messages": MSG}) for i in range(3)).encode()
    f = alice.files.create(file=("secret.jsonl", io.BytesIO(data)), purpose="batch")
    done = wait_batch(
        alice, alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
    )
    assert done.status == "completed" and done.output_file_id is not None
    running = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for file_id in (f.id, done.output_file_id):
        with pytest.raises(openai.NotFoundError):
            bob.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            bob.files.content(file_id)
    for batch_id in (done.id, running.id):
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(batch_id)
        with pytest.raises(openai.NotFoundError):
            bob.batches.cancel(batch_id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert bob.batches.list().data == []
    assert bob.batches.list(after=done.id).data == []
    mine = bob.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")  # bob's own work is his
    theirs = bob.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert [b.id for b in bob.batches.list().data] == [theirs.id]
    # the owner still sees and runs all of hers
    assert {b.id for b in alice.batches.list().data} == {done.id, running.id}
    assert len(jsonl(alice, done.output_file_id)) == 3
    assert wait_batch(alice, running.id).status == "completed"


def test_a_store_made_before_owners_opens_and_keeps_its_rows(tmp_path: Path) -> None:
    import sqlite3

    db = sqlite3.connect(tmp_path / "batches.sqlite3")
    db.executescript("""
CREATE TABLE files (id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE batches (id TEXT PRIMARY KEY, doc TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL);
INSERT INTO files VALUES ('file-old', 'batch', 'in.jsonl', 3, 0);
INSERT INTO batches VALUES ('batch_old', '{"id": "batch_old", "status": "completed"}', 'completed', 0);
""")
    db.close()

    async def go() -> None:
        store = await BatchStore.open(tmp_path)
        try:
            assert await store.file("file-old") is not None and await store.batch("batch_old") is not None  # as before
            assert await store.file("file-old", "somekey") is None and await store.batches(10, None, "somekey") == []
            await store.add_file(b"x", "new.jsonl", "batch", "somekey")
            assert await store.batches(10, None) == [{"id": "batch_old", "status": "completed"}]
        finally:
            await store.close()

    asyncio.run(go())


# --- 7. upstream credentials and addresses never reach the client -------------------------------------------

SECRET = "sk-upstream-0123456789abcdef"
# what no pattern list finds: an access key id, a token, a header, a password, Basic credentials, a bare host
OTHER_LEAKS = "AKIAIOSFODNN7EXAMPLE ghp_abcdefghijklmnop x-api-key: hunter2 password=hunter3 Basic dXNlcjpwYXNz db7"


def fake_engine(request: Request) -> JSONResponse:
    """An engine that answers every call with the error its path names."""
    if request.url.path.startswith("/leaky"):
        return JSONResponse(
            {
                "error": {
                    "message": f"bad request at 10.1.2.3:8000 from http://pool.internal:81/v1 with Bearer {SECRET}, "
                    f"{OTHER_LEAKS}",
                    "type": "invalid_request_error",
                }
            },
            400,
        )
    if request.url.path.startswith("/toolong"):
        text = "This model's maximum context length is 2048 tokens; your prompt has 9000 (at pool.internal)"
        return JSONResponse({"error": {"message": text, "type": "BadRequestError", "code": 400}}, 400)
    return JSONResponse(
        {
            "error": {
                "message": f"Incorrect API key provided: Bearer {SECRET}",
                "type": "invalid_request_error",
                "code": "invalid_api_key",
            }
        },
        401,
    )


@pytest.fixture
def engine() -> Iterator[str]:
    """The fake engine under a real uvicorn; its base URL."""
    app = Starlette(routes=[Route("/{path:path}", fake_engine, methods=["GET", "POST"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_upstream_credentials_and_addresses_never_reach_the_client(
    gateway: Callable[..., Gateway], engine: str
) -> None:
    upstream = gateway(policy())  # a real OpenAI-compatible engine: a triage gateway on a scripted backend
    refused_port = str(free_port())  # nothing listens there
    refused = f"http://127.0.0.1:{refused_port}/v1"
    gw = gateway(f"""version: 1
backends:
  mixed:
    type: openai
    strategy: round_robin
    replicas: [{{api_base: "{engine}/v1"}}, {{api_base: "{upstream.base_url}/v1"}}]
    health: {{enabled: false}}
  unauthorized: {{type: openai, replicas: [{{api_base: "{engine}/v1"}}], health: {{enabled: false}}}}
  refused: {{type: openai, replicas: [{{api_base: "{refused}"}}], health: {{enabled: false}}}}
  leaky: {{type: openai, replicas: [{{api_base: "{engine}/leaky"}}], health: {{enabled: false}}}}
  toolong: {{type: openai, replicas: [{{api_base: "{engine}/toolong"}}], health: {{enabled: false}}}}
models:
  scripted: {{backend: mixed}}
  unauthorized: {{backend: unauthorized, upstream: scripted}}
  refused: {{backend: refused, upstream: scripted}}
  leaky: {{backend: leaky, upstream: scripted}}
  toolong: {{backend: toolong, upstream: scripted}}
""")
    client = gw.client()
    with structlog.testing.capture_logs() as logs:
        for _ in range(4):  # the replica that refuses the gateway's key is a replica fault: the other answers
            assert client.chat.completions.create(model="scripted", messages=MSG).choices[0].message.content
        answers = {}
        with gw.http() as http:
            for model in ("unauthorized", "refused", "leaky", "toolong"):
                answers[model] = http.post("/v1/chat/completions", json={"model": model, "messages": MSG})
    for model, status in (("unauthorized", 502), ("refused", 502), ("leaky", 400), ("toolong", 400)):
        resp = answers[model]
        assert resp.status_code == status, (model, resp.text)
        err, raw = error_of(resp), resp.text
        leaks = (SECRET, "Bearer", "127.0.0.1", engine.rsplit(":", 1)[1], refused_port, "10.1.2.3", "pool.internal")
        assert not [leak for leak in leaks + tuple(OTHER_LEAKS.split()) if leak in raw], (model, raw)
        assert err["type"] == ("upstream_error" if status == 502 else "invalid_request_error")
    assert error_of(answers["unauthorized"])["code"] == "upstream_auth_failed"  # never the client's invalid_api_key
    failed = [e for e in logs if e["event"] == "upstream_failed"]
    assert any(e["status"] == 401 and SECRET in e["detail"] and e["replica"] == engine + "/v1" for e in failed)
    assert any(refused_port in (e["detail"] or "") for e in failed)  # the operator sees where
    # a refused request: the client reads the status and a generic text; the upstream's words are logged
    assert error_of(answers["leaky"])["message"] == "upstream leaky refused the request (HTTP 400)"
    assert error_of(answers["toolong"])["code"] == "context_length_exceeded"  # said by a code, not the words
    rejected = {e["backend"]: e for e in logs if e["event"] == "upstream_rejected"}
    assert OTHER_LEAKS in rejected["leaky"]["detail"] and rejected["leaky"]["request_id"]


# --- 8. after a 500 the keep-alive connection still works ---------------------------------------------------


def test_after_a_500_the_same_keep_alive_connection_keeps_working(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    explode_in(gw)
    host, port = gw.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)

    def post(body: dict[str, Any]) -> tuple[int, dict[str, Any], str | None]:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read()), resp.getheader("connection")

    boom = {"model": "scripted", "messages": [{"role": "user", "content": "explode"}]}
    try:
        with structlog.testing.capture_logs() as logs:
            status, body, _ = post(boom)
            conn_port = conn.sock.getsockname()[1]
            assert status == 500 and body["error"]["type"] == "server_error" and "a bug" not in json.dumps(body)
            status, body, _ = post(boom | {"stream": True})  # a stream that fails before its first byte: the same
            assert status == 500 and set(body["error"]) == {"message", "type", "param", "code"}
            for _ in range(5):
                status, body, connection = post({"model": "scripted", "messages": MSG})
                assert status == 200 and body["choices"][0]["message"]["content"] == "fine thanks"
                assert connection != "close" and conn.sock.getsockname()[1] == conn_port  # one connection all along
    finally:
        conn.close()
    unhandled = [e for e in logs if e["event"] == "unhandled_error"]
    assert len(unhandled) == 2 and all(e["exc_info"] for e in unhandled)
    assert [e["status"] for e in logs if e["event"] == "request"] == [500, 500, 200, 200, 200, 200, 200]
    with httpx.Client(base_url=gw.base_url) as h:
        assert h.get("/metrics").status_code == 200


# --- 5. slowloris -------------------------------------------------------------------------------------------


def raw_socket(gw: Gateway) -> socket.socket:
    host, port = gw.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_all(s: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_stalled_senders_hold_no_slot_and_are_cut_off(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(extra="limits: {max_concurrency: 16, body_timeout_s: 1.5}\n"))  # 30 s by default
    stalled = [raw_socket(gw) for _ in range(16)]
    for s in stalled:  # headers and 13 bytes of a declared 1,000-byte body, then nothing
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": "sc'
        )
    time.sleep(0.3)  # every one of them is inside, waiting for its body
    t0 = time.monotonic()
    for _ in range(3):  # a 17th client, and more, are served at once
        assert gw.client().chat.completions.create(model="scripted", messages=MSG).choices
    assert time.monotonic() - t0 < 1.0
    for s in stalled:
        answer = read_all(s)
        s.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), answer
        assert json.loads(body)["error"]["code"] == "request_timeout"
    still_serving(gw)


# --- 6. max_file_bytes on a chunked upload ------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_chunked_upload_over_the_limit_is_refused_while_it_streams(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}", max_file_bytes: 1048576}}\n'))
    s = raw_socket(gw)
    s.sendall(
        b"POST /v1/files HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: multipart/form-data; boundary=BOUNDARY\r\n\r\n"
    )
    preamble = (
        b'--BOUNDARY\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--BOUNDARY\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n"
    )
    s.sendall(b"%x\r\n%s\r\n" % (len(preamble), preamble))
    block = b"x" * 65536
    chunk = b"%x\r\n%s\r\n" % (len(block), block)
    peak, before, sent, answer = 0, rss_bytes(), 0, b""
    try:
        while sent < 300 * 2**20:  # 300 MiB offered, against a 1 MiB limit
            s.sendall(chunk)
            sent += len(block)
            if sent % 2**20 == 0:
                peak = max(peak, rss_bytes())
            if sent > 2**20 and select.select([s], [], [], 0.2)[0]:  # past the limit: has it answered?
                answer = read_all(s)
                break
    except (BrokenPipeError, ConnectionResetError):
        pass  # it hung up before its answer could be read; the size sent still tells
    finally:
        s.close()
    peak = max(peak, rss_bytes())
    assert sent < 32 * 2**20, sent  # refused early, not after buffering the upload
    assert peak - before < 10 * 2**20, (before, peak)
    assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower(), answer[:300]
    still_serving(gw)


# --- 9. smaller defects -------------------------------------------------------------------------------------


def metric_line(gw: Gateway, prefix: str) -> str | None:
    with gw.http() as http:
        return next((x for x in http.get("/metrics").text.splitlines() if x.startswith(prefix)), None)


def test_a_client_that_leaves_mid_upload_is_a_499_not_an_unhandled_error(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}"}}\n'))
    with structlog.testing.capture_logs() as logs:
        for head in (
            b"POST /v1/files HTTP/1.1\r\nHost: gw\r\nContent-Length: 100000\r\n"
            b"Content-Type: multipart/form-data; boundary=BOUNDARY\r\n\r\n"
            b'--BOUNDARY\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"cust',
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 1000\r\n\r\n"
            b'{"model": "scripted", "mess',
        ):
            s = raw_socket(gw)
            s.sendall(head)
            time.sleep(0.2)
            s.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len([e for e in logs if e["event"] in ("client_gone", "request")]) < 2:
            time.sleep(0.05)
    assert not [e for e in logs if e["event"] == "unhandled_error"], logs
    [gone] = [e for e in logs if e["event"] == "client_gone"]
    assert (gone["path"], gone["status"]) == ("/v1/files", 499)
    [request] = [e for e in logs if e["event"] == "request"]
    assert request["status"] == 499 and request["error"]["code"] == "client_closed_request"
    line = metric_line(gw, 'triage_errors_total{status="499",type="client_closed_request"}')
    assert line is not None and line.endswith(" 2.0"), line
    assert metric_line(gw, 'triage_errors_total{status="500"') is None
    still_serving(gw)


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET"), ("PUT", "/v1/batches", "GET, POST")],
)
def test_a_405_says_which_methods_are_allowed(
    gateway: Callable[..., Gateway], method: str, path: str, allow: str
) -> None:
    gw = gateway(policy())
    with gw.http() as http:
        resp = http.request(method, path)
    assert resp.status_code == 405
    assert sorted(resp.headers["allow"].split(", ")) == sorted(allow.split(", "))
    assert error_of(resp)["type"] == "invalid_request_error"


def test_a_duplicated_custom_id_gets_an_error_line_without_that_id(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}"}}\n'))
    client = gw.client()
    ok = {"model": "scripted", "messages": MSG}
    lines = [
        batch_line("a", ok),
        batch_line("a", ok),  # a second a: its error line must not be read as a's result
        batch_line("b", ok),
        batch_line("c", {"model": "nope", "messages": MSG}),  # c fails ...
        batch_line("c", ok),  # ... and a second c does not run: c has one entry, its error
    ]
    f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 2, 3)
    out, errors = jsonl(client, batch.output_file_id), jsonl(client, batch.error_file_id)
    assert sorted(o["custom_id"] for o in out) == ["a", "b"]
    by_line = {e["error"]["message"].split(":")[0]: e for e in errors}
    assert by_line["line 2"]["custom_id"] is None
    assert "custom_id 'a' is used twice (first on line 1)" in by_line["line 2"]["error"]["message"]
    assert by_line["line 4"]["custom_id"] == "c"
    assert by_line["line 5"]["custom_id"] is None and "first on line 4" in by_line["line 5"]["error"]["message"]
    ids = [o["custom_id"] for o in out + errors if o["custom_id"] is not None]
    assert len(ids) == len(set(ids))  # every id has one entry


def test_completions_refuse_an_empty_prompt_list(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    with pytest.raises(openai.BadRequestError) as caught:
        gw.client().completions.create(model="echo", prompt=[])
    assert caught.value.status_code == 400 and caught.value.body["param"] == "prompt"  # type: ignore[index]
    assert gw.client().completions.create(model="echo", prompt="").choices  # an empty string is a prompt


@pytest.mark.parametrize("part", [{"type": "text", "text": 5}, {"type": "text"}, {"text": "no type"}])
def test_a_malformed_content_part_is_a_400_naming_the_messages(gateway: Callable[..., Gateway], part: dict) -> None:
    gw = gateway(policy())
    with gw.http() as client:
        for model in ("echo", "auto"):  # a plain model, and the cascade model that reads the text for a typed ask
            r = client.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": [part]}]},
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"].startswith("messages")
        ok = {"model": "echo", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
        assert client.post("/v1/chat/completions", json=ok).status_code == 200  # still serving


def test_ready_is_503_while_a_models_only_backend_is_down(gateway: Callable[..., Gateway]) -> None:
    dead = POLICY.replace(
        "health: {enabled: false}", "health: {interval_s: 0.1, timeout_s: 0.5, cooldown_s: 60}"
    ).replace("LATENCY", "0")
    gw = gateway(dead)
    with gw.http() as http:
        for _ in range(100):
            resp = http.get("/ready")
            if resp.status_code == 503:
                break
            time.sleep(0.05)
        assert resp.status_code == 503, resp.text  # script and echo are up; pool, pool's only backend, is not
        assert resp.json() == {"status": "not_ready", "backends": {"script": True, "echo": True, "pool": False}}
    with_fallback = dead.replace("pool: {backend: pool}", "pool: {backend: pool, fallbacks: [scripted]}")
    gw = gateway(with_fallback)
    time.sleep(0.5)
    with gw.http() as http:
        resp = http.get("/ready")
    assert resp.status_code == 200 and resp.json()["backends"]["pool"] is False  # pool still has a way to answer


def test_an_unset_secret_is_a_warning_in_validate_and_serve_says_so_without_a_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "p.yaml"
    path.write_text(POLICY.replace("LATENCY", "0").replace('9/v1"}', '9/v1", api_key: "env:TRIAGE_TEST_UNSET_KEY"}'))
    env = {k: v for k, v in os.environ.items() if k != "TRIAGE_TEST_UNSET_KEY"}
    cli = [sys.executable, "-m", "gateway.cli"]
    run = subprocess.run([*cli, "validate", str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"warning: {path}:7:" in run.stderr and "TRIAGE_TEST_UNSET_KEY is not set" in run.stderr, run.stderr
    assert "backends.pool.replicas[0].api_key" in run.stderr
    run = subprocess.run(
        [*cli, "serve", "--policy", str(path), "--port", str(free_port()), "--no-watch"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 2 and "TRIAGE_TEST_UNSET_KEY is not set" in run.stderr
    assert "Traceback" not in run.stderr
    run = subprocess.run(
        [*cli, "validate", str(path)], capture_output=True, text=True, env=env | {"TRIAGE_TEST_UNSET_KEY": "k"}
    )
    assert run.returncode == 0 and "warning" not in run.stderr


# --- 9. file deletion and expiry ----------------------------------------------------------------------------


def test_a_file_is_deleted_by_its_owner_only(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}"}}\n' + keys("sk-alice", "sk-bob")))
    alice, bob = gw.client("sk-alice"), gw.client("sk-bob")
    f = alice.files.create(file=("a.jsonl", io.BytesIO(b'{"x": 1}\n')), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        bob.files.delete(f.id)
    assert alice.files.retrieve(f.id).id == f.id  # bob's try left it there
    deleted = alice.files.delete(f.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (f.id, "file", True)
    assert not (tmp_path / "b" / "files" / f.id).exists()
    for call in (alice.files.retrieve, alice.files.content, alice.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)


def test_a_file_expires_after_its_seconds_and_the_sweeper_removes_it(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}", sweep_interval_s: 0.2, min_expires_after_s: 1}}\n'))
    client = gw.client()
    data = io.BytesIO(b'{"x": 1}\n')
    # created_at is whole seconds, so a file may expire up to a second before `seconds` have passed:
    # 3 s leaves at least 2 for the reads below on a loaded machine
    short = client.files.create(
        file=("s.jsonl", data), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3}
    )
    assert client.files.retrieve(short.id).expires_at == short.expires_at == short.created_at + 3
    kept = client.files.create(file=("k.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert kept.expires_at is None
    with structlog.testing.capture_logs() as logs:
        deadline = time.monotonic() + 15
        while (tmp_path / "b" / "files" / short.id).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not (tmp_path / "b" / "files" / short.id).exists()
    assert any(e["event"] == "files_expired" and short.id in e["files"] for e in logs)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(short.id)
    assert client.files.retrieve(kept.id).id == kept.id
    for bad in ({"anchor": "created_at", "seconds": 0}, {"anchor": "last_active_at", "seconds": 60}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after=bad)  # type: ignore[arg-type]
        assert caught.value.body["param"].startswith("expires_after")  # type: ignore[index]


def test_expires_after_shorter_than_openais_hour_is_refused_by_default(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}"}}\n'))
    with pytest.raises(openai.BadRequestError) as caught:
        gw.client().files.create(
            file=("x.jsonl", io.BytesIO(b"{}\n")),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 60},
        )
    assert "from 3600 to 2592000" in caught.value.message
    f = gw.client().files.create(
        file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert f.expires_at == f.created_at + 3600


# --- 9. the operator key; /metrics and /openapi.json behind the key ----------------------------------------


def test_an_operator_key_sees_every_keys_files_and_batches(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    extra = f'batches: {{dir: "{tmp_path / "b"}"}}\n' + keys("sk-alice", "sk-bob", "sk-ops")
    gw = gateway(policy(extra=extra + "access: {operator_keys: [sk-ops]}\n"))
    alice, bob, ops = gw.client("sk-alice"), gw.client("sk-bob"), gw.client("sk-ops")
    data = batch_line("c0", {"model": "scripted", "messages": MSG}).encode()
    f = alice.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert ops.files.retrieve(f.id).id == f.id and ops.files.content(f.id).read() == data
    assert [b.id for b in ops.batches.list().data] == [batch.id]
    done = wait_batch(ops, batch.id)
    assert jsonl(ops, done.output_file_id)[0]["custom_id"] == "c0"
    mine = ops.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert [b.id for b in alice.batches.list().data] == [batch.id]  # the operator's own batch is its own
    assert sorted(b.id for b in ops.batches.list().data) == sorted([batch.id, mine.id])
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(f.id)  # an ordinary key still sees only its own
    assert ops.files.delete(f.id).deleted


def test_an_operator_key_must_name_a_key() -> None:
    from policies import loader
    from policies.errors import PolicyInvalid

    with pytest.raises(PolicyInvalid) as caught:
        loader.parse(policy(extra=keys("sk-alice") + "access: {operator_keys: [root]}\n"))
    assert any("access.operator_keys[0]: key 'root' is not defined in keys" in p for p in caught.value.problems)


@pytest.mark.parametrize("public_metrics", [False, True])
def test_metrics_and_openapi_need_the_key_when_keys_are_on(
    gateway: Callable[..., Gateway], public_metrics: bool
) -> None:
    gw = gateway(policy(extra=keys("sk-alice") + f"access: {{public_metrics: {str(public_metrics).lower()}}}\n"))
    auth = {"authorization": "Bearer sk-alice"}
    with gw.http() as http:
        assert http.get("/metrics").status_code == (200 if public_metrics else 401)
        assert http.get("/openapi.json").status_code == 401  # a scraper's exemption is /metrics only
        assert error_of(http.get("/openapi.json"))["code"] == "invalid_api_key"
        assert http.get("/metrics", headers=auth).text.startswith("# HELP")
        assert http.get("/openapi.json", headers=auth).json()["openapi"].startswith("3.1")
        assert http.get("/health").status_code == 200


def test_metrics_and_openapi_are_open_without_keys(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    with gw.http() as http:
        assert http.get("/metrics").status_code == 200 and http.get("/openapi.json").status_code == 200
