"""A fuzz run on the OpenAPI document (issue 16): schemathesis generates requests for every
operation, valid and not, against a running gateway; none may be a 500 (or any 5xx the document
does not name), and every error is in the API's own shape. A bounded run here; ``make fuzz`` runs
more (FUZZ_EXAMPLES)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from gateway.openapi import document  # noqa: E402
from tests.conftest import Gateway, GatewayRunner  # noqa: E402
from tests.test_hardening import policy  # noqa: E402

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))  # per operation
schema = schemathesis.openapi.from_dict(document("triage", "0.1.0", keys=False))
keyed_schema = schemathesis.openapi.from_dict(document("triage", "0.1.0", keys=True))
KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("fuzz")
    runner = GatewayRunner(tmp)
    yield runner.start(policy(extra=f'batches: {{dir: "{tmp / "b"}", min_expires_after_s: 1}}\n'))
    runner.stop_all()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The same gateway with API keys on (the fuzzer sends the key: the authorised paths run)."""
    import hashlib

    tmp = tmp_path_factory.mktemp("fuzz-keyed")
    runner = GatewayRunner(tmp)
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    extra = f'batches: {{dir: "{tmp / "b"}", min_expires_after_s: 1}}\nkeys:\n  - {{name: fuzz, sha256: {digest}}}\n'
    yield runner.start(policy(extra=extra))
    runner.stop_all()


def documented(case: schemathesis.Case, status: int) -> bool:
    return str(status) in case.operation.definition.raw["responses"]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_no_500_and_every_error_in_the_api_shape(case: schemathesis.Case, fuzzed: Gateway) -> None:
    _check(case, case.call(base_url=fuzzed.base_url, timeout=30))


@keyed_schema.parametrize()
@settings(
    max_examples=max(1, EXAMPLES // 5),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_with_keys_on_no_500_either(case: schemathesis.Case, keyed: Gateway) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY}
    _check(case, case.call(base_url=keyed.base_url, timeout=30, headers=headers))


def _check(case: schemathesis.Case, resp: Any) -> None:
    assert resp.status_code != 500, (case.method, case.path, resp.text[:500])
    assert resp.status_code < 500 or documented(case, resp.status_code), (case.method, case.path, resp.status_code)
    media = (resp.headers.get("content-type") or [""])[0]  # schemathesis keeps each header's values in a list
    if resp.status_code >= 400 and media.startswith("application/json") and case.path == "/v1/messages":
        body = resp.json()  # Anthropic's shape
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), resp.text[:500]
        assert isinstance(body["error"]["type"], str)
    elif resp.status_code >= 400 and media.startswith("application/json"):
        error = resp.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), resp.text[:500]  # extensions (a trace) may follow
        assert isinstance(error["message"], str) and isinstance(error["type"], str)


def test_the_module_fuzzes_every_operation() -> None:
    assert len(list(schema.get_all_operations())) == sum(len(v) for v in document("t", "0", False)["paths"].values())
    assert len(list(keyed_schema.get_all_operations())) == len(list(schema.get_all_operations()))
    assert Path(__file__).name == "test_fuzz.py"


def test_stateful_sequences_follow_the_links(fuzzed: Gateway) -> None:
    """Sequences that follow the document's links (a file uploaded, then read, used by a batch,
    the batch read and cancelled, the file deleted; a stored response read and deleted): no 500 and
    every error in the API's shape at any step."""
    machine = schema.as_state_machine()

    class Sequences(machine):  # type: ignore[misc, valid-type]
        def get_call_kwargs(self, case: schemathesis.Case) -> dict[str, Any]:
            return {"base_url": fuzzed.base_url, "timeout": 30}

        def validate_response(self, response: Any, case: schemathesis.Case, **kwargs: Any) -> None:
            _check(case, response)
            seen.add((case.method, case.path, response.status_code))

    seen: set[tuple[str, str, int]] = set()
    Sequences.run(
        settings=settings(
            max_examples=max(2, EXAMPLES // 2),
            stateful_step_count=6,
            deadline=None,
            derandomize=True,  # the same sequences every run: what is asserted below does not flake
            suppress_health_check=list(HealthCheck),
        )
    )
    followed = {(m, p) for m, p, status in seen if status == 200}
    linked = {("GET", "/v1/files/{file_id}"), ("GET", "/v1/files/{file_id}/content"), ("DELETE", "/v1/files/{file_id}")}
    assert ("POST", "/v1/files") in followed and followed & linked, sorted(seen)  # an upload's id was followed
