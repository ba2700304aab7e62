"""Hostile and broken inputs (issue 16): each is answered in the API's own error shape, logged, and
the server keeps serving. Official client and raw HTTP against a real uvicorn; upstreams are real
triage gateways, or a small fake engine where an upstream must misbehave."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import structlog

from tests.conftest import Gateway
from tests.test_errors import MSG, error_of

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
        gateway: Callable[..., Gateway], depth: int) -> None:
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


@pytest.mark.parametrize(("json_schema", "param"), [
    ('"x"', "response_format.json_schema"),
    ("5", "response_format.json_schema"),
    ("[]", "response_format.json_schema"),
    ("null", "response_format.json_schema"),
    ('{"name": "x", "schema": "x"}', "response_format.json_schema.schema"),
    ('{"name": "x", "schema": [1]}', "response_format.json_schema.schema"),
])
def test_a_json_schema_that_is_not_an_object_is_a_400_naming_it(
        gateway: Callable[..., Gateway], json_schema: str, param: str) -> None:
    gw = gateway(policy())
    body = chat("auto", response_format=f'{{"type": "json_schema", "json_schema": {json_schema}}}')
    with gw.http() as http:
        resp = http.post("/v1/chat/completions", content=body)
    assert resp.status_code == 400, resp.text
    assert error_of(resp)["param"] == param
    still_serving(gw)
