"""Hostile and broken inputs (issue 16): each is answered in the API's own error shape, logged, and
the server keeps serving. Official client and raw HTTP against a real uvicorn; upstreams are real
triage gateways, or a small fake engine where an upstream must misbehave."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from backends.base import Call, ChunkStream, Completion
from tests.conftest import Gateway, free_port
from tests.http.test_errors import MSG, error_of
from tests.servers import asgi_server

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


def keys(*names: str) -> str:
    return "keys:\n" + "".join(
        f"  - {{name: {n}, sha256: '{hashlib.sha256(n.encode()).hexdigest()}'}}\n" for n in names
    )


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
    with asgi_server(Starlette(routes=[Route("/{path:path}", fake_engine, methods=["GET", "POST"])])) as url:
        yield url


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
