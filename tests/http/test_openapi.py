"""The OpenAPI 3.1 document (issue 16, item 10): every route the app serves, with its request body
and response schemas, fetched from a running gateway; bodies the official client sends validate."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gateway.http import api, batch_api
from tests.conftest import Gateway
from tests.http.test_hardening import policy

BODIES = {  # what the official client and the docs send: each must validate against its schema
    ("/v1/chat/completions", "post"): {"model": "auto", "messages": [{"role": "user", "content": "hi"}]},
    ("/v1/completions", "post"): {"model": "echo", "prompt": "x", "max_tokens": 4},
    ("/v1/decide", "post"): {"question": "2+2?", "type": "choice", "options": ["3", "4"]},
    ("/v1/decide/batch", "post"): {"questions": [{"question": "sky blue?", "type": "yes_no"}]},
    ("/v1/batches", "post"): {
        "input_file_id": "file-1",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    },
}


def served_operations() -> set[tuple[str, str]]:
    """(path, method) of every route the app serves, paths as OpenAPI writes them."""
    ops = set()
    for route in [*api.HOT_ROUTES, *api.router.routes, *batch_api.router.routes]:
        if route.path == "/openapi.json":
            continue
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
        ops |= {(path, m.lower()) for m in route.methods or () if m != "HEAD"}
    return ops


@pytest.fixture
def doc(gateway: Callable[..., Gateway]) -> dict[str, Any]:
    gw = gateway(policy())
    with gw.http() as http:
        resp = http.get("/openapi.json")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    return resp.json()


def resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    return doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]


def test_every_route_is_in_the_document_with_its_schemas(doc: dict[str, Any]) -> None:
    assert doc["openapi"] == "3.1.0"
    listed = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert listed == served_operations()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/decide", "/v1/decide/batch", "/v1/files",
                 "/v1/batches", "/v1/models", "/health", "/ready", "/metrics"):  # fmt: skip
        assert path in doc["paths"], path
    for (path, method), op in ((k, doc["paths"][k[0]][k[1]]) for k in listed):
        ok = op["responses"]["200"]["content"]
        assert ok, (path, method)
        if "application/json" in ok:
            assert resolve(doc, ok["application/json"]["schema"])["properties"], (path, method)
        shape = "AnthropicErrorBody" if path == "/v1/messages" else "ErrorBody"  # each API's own error shape
        for status, answer in op["responses"].items():
            if status != "200":
                assert answer["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{shape}"}
        if method == "post" and not path.endswith("/cancel"):  # a POST that reads a body says which
            [media] = op["requestBody"]["content"]
            assert resolve(doc, op["requestBody"]["content"][media]["schema"])["properties"], path


def test_request_schemas_take_real_bodies_and_refuse_bad_ones(doc: dict[str, Any]) -> None:
    defs = {"components": doc["components"]}
    for (path, method), body in BODIES.items():
        ref = doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        validator = jsonschema.Draft202012Validator({**ref, **defs})
        validator.validate(body)
        with pytest.raises(jsonschema.ValidationError):
            validator.validate({**body, "model": 5} if "model" in body else {**body, "type": "nope"} | {"endpoint": 1})
    upload = resolve(doc, doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"])
    assert {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"} <= set(upload["properties"])
    assert set(upload["required"]) == {"file", "purpose"}


def test_the_document_says_the_key_is_needed_when_keys_are_on(gateway: Callable[..., Gateway]) -> None:
    from tests.http.test_hardening import keys

    gw = gateway(policy(extra=keys("sk-a")))
    with gw.http() as http:
        doc = http.get("/openapi.json", headers={"authorization": "Bearer sk-a"}).json()
    assert doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"]["security"] == [] and "security" not in doc["paths"]["/metrics"]["get"]


def test_the_batch_body_model_takes_the_endpoints_the_runner_serves(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    import typing

    from gateway.batch.runner import ENDPOINTS
    from gateway.service.bodies import BatchCreate

    assert typing.get_args(BatchCreate.model_fields["endpoint"].annotation) == ENDPOINTS
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}"}}\n'))
    with gw.http() as http:
        for body, param in (
            ({"endpoint": "/v1/chat/completions"}, "input_file_id"),
            ({"input_file_id": "file-x", "endpoint": "/v1/embeddings"}, "endpoint"),
            (
                {"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "1h"},
                "completion_window",
            ),
            ({"input_file_id": "file-x", "endpoint": "/v1/completions", "metadata": {"a": 1}}, "metadata.a"),
        ):
            resp = http.post("/v1/batches", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        resp = http.post("/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/completions"})
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "input_file_id"
