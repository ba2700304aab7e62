"""A client that leaves cancels its work (issue 51, item 4): a plain (unstreamed) request whose
client closes its connection while a local engine generates gives the model back at once, on
every surface, as a stream does; it used to hold the model until its deadline. A real SmolLM2
worker under a real uvicorn; the client is a raw socket that sends a long generation, waits
until the engine runs it, and closes. Not a timing test: the bound on the next request is many
times what a short request takes and a small part of what the abandoned one would have held."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests import lanes
from tests.backends.test_engines import COUNTING, POLICY, host_of, running, wait_for
from tests.conftest import Gateway, GatewayRunner

DEADLINE_S = 120  # the engine's deadline: far from anything measured here
LOCAL = POLICY.replace(
    "timeouts: {total_s: 60, first_byte_s: 60}", f"timeouts: {{total_s: {DEADLINE_S}, first_byte_s: {DEADLINE_S}}}"
)
# a chat answer that cannot end early: 200 integers (a grammar of SmolLM2's own tokens, several seconds)
LONG_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "array", "items": {"type": "integer"}, "minItems": 200, "maxItems": 200}},
    "required": ["n"],
}
ASK = [{"role": "user", "content": "List two hundred numbers."}]
NEXT_WITHIN_S = 5.0  # the next short request; measured 2026-12-07: see docs/operations.md


@pytest.fixture(scope="module")
@lanes.engine
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    runner = GatewayRunner(tmp_path_factory.mktemp("cancel"))
    gw = runner.start(LOCAL)
    gw.client().chat.completions.create(model="smollm2", messages=ASK, max_tokens=1)  # warm
    yield gw
    runner.stop_all()


def long_requests() -> dict[str, tuple[str, dict[str, Any]]]:
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": LONG_SCHEMA}}
    return {
        "chat": (
            "/v1/chat/completions",
            {"model": "smollm2", "messages": ASK, "max_tokens": 900, "response_format": fmt},
        ),
        "completions": (
            "/v1/completions",
            {"model": "smollm2", "prompt": COUNTING, "max_tokens": 900, "temperature": 0},
        ),
        "responses": (
            "/v1/responses",
            {
                "model": "smollm2",
                "input": ASK,
                "max_output_tokens": 900,
                "text": {"format": {"type": "json_schema", "name": "n", "schema": LONG_SCHEMA}},
            },
        ),
        "messages": (
            "/v1/messages",
            {
                "model": "smollm2",
                "messages": ASK,
                "max_tokens": 900,
                "output_config": {"format": {"type": "json_schema", "schema": LONG_SCHEMA}},
            },
        ),
    }


def send_and_leave(gw: Gateway, path: str, body: dict[str, Any], after_s: float = 1.0) -> None:
    """POST ``body`` on a raw connection, and close it ``after_s`` after the engine started it
    (the engine still running it then)."""
    url = urlsplit(gw.base_url)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer none\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    host = host_of(gw)
    with socket.create_connection((url.hostname, url.port)) as conn:
        conn.sendall(head + data)
        wait_for(lambda: running(host), what="the engine to start the request")
        time.sleep(after_s)
        assert running(host), "the request ended before its client left: nothing to cancel"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("surface", ["chat", "completions", "responses", "messages"])
def test_a_client_that_leaves_gives_the_model_back(local: Gateway, surface: str, stream: bool) -> None:
    host = host_of(local)
    wait_for(lambda: not host._jobs, what="the engine to be idle")
    pid, restarts = host.pid, host.restarts
    path, body = long_requests()[surface]
    send_and_leave(local, path, body | ({"stream": True} if stream else {}))
    left = time.monotonic()
    wait_for(lambda: not host._jobs, timeout=NEXT_WITHIN_S, what="the abandoned job to be cancelled")
    reply = local.client().chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    took = time.monotonic() - left
    assert reply.choices[0].message.content is not None
    assert took < NEXT_WITHIN_S, f"the next request waited {took:.2f}s behind an abandoned one"
    assert host.pid == pid and host.restarts == restarts  # cancelled at a token, not a killed worker
