"""The litellm backend, against the real llama.cpp server, plain and streamed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.service import assemble
from policies import loader
from policies.errors import PolicyInvalid
from tests.conftest import Gateway, LlamaServer, free_port

MSG = [{"role": "user", "content": "Say hello."}]


def litellm_policy(*api_bases: str) -> str:
    replicas = "".join(f"      - {{api_base: '{b}', api_key: 'env:TRIAGE_TEST_LITELLM_KEY'}}\n" for b in api_bases)
    return f"""version: 1
backends:
  via-litellm:
    type: litellm
    replicas:
{replicas}    retries: {{attempts: 2, backoff_s: 0.01}}
    health: {{enabled: false}}
models:
  smollm2:
    backend: via-litellm
    upstream: openai/smollm2
"""


@pytest.fixture
def gw(gateway: Callable[..., Gateway], llama_server: LlamaServer, monkeypatch: pytest.MonkeyPatch) -> Gateway:
    monkeypatch.setenv("TRIAGE_TEST_LITELLM_KEY", "unused")
    dead = f"http://127.0.0.1:{free_port()}/v1"
    return gateway(litellm_policy(dead, llama_server.api_base))


def test_litellm_chat_and_stream_with_a_dead_replica_first(gw: Gateway) -> None:
    client = gw.client()
    out = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=6, temperature=0)
    assert out.choices[0].message.content
    assert out.model == "smollm2"
    assert out.usage.prompt_tokens > 0
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=6, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == out.choices[0].message.content
    with gw.http() as http:
        metrics = http.get("/metrics").text
    assert 'backend="via-litellm",outcome="error"' in metrics  # the dead replica was tried, then ejected


def test_missing_secret_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRIAGE_TEST_LITELLM_KEY", raising=False)
    policy = loader.parse(litellm_policy("http://127.0.0.1:9/v1"))
    with pytest.raises(PolicyInvalid) as info:
        asyncio.run(assemble.build(policy))
    assert info.value.problems == ["backends.via-litellm: environment variable TRIAGE_TEST_LITELLM_KEY is not set"]
