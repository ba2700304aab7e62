"""``/v1/messages`` through the official anthropic client: against a real llama.cpp engine (plain
and streamed), the request as the engine receives it, errors in Anthropic's shape, the key in
``x-api-key``, and a stream the engine cuts."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator

import anthropic
import pytest

from tests.conftest import Gateway, LlamaServer
from tests.http.test_openai_surface import pool_policy

KEY = "sk-anthropic-test"
SCRIPTED = """version: 1
backends:
  echo: {type: scripted, echo: true}
  cheap: {type: scripted, text: "fine thanks"}
  broken: {type: scripted, text: "one two three four five six", chunks: 6, die_after_chunks: 2}
models:
  echo: {backend: echo}
  cheap: {backend: cheap}
  broken: {backend: broken}
"""


_OPEN: list[anthropic.Anthropic] = []


def client(gw: Gateway, key: str = "none") -> anthropic.Anthropic:
    """The official client (closed after each test by ``_close_clients``)."""
    made = anthropic.Anthropic(base_url=gw.base_url, api_key=key, max_retries=0)
    _OPEN.append(made)
    return made


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


@pytest.fixture
def engine(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> Gateway:
    return gateway(pool_policy(llama_server.api_base))


def test_a_message_from_the_engine(engine: Gateway) -> None:
    out = client(engine).messages.create(
        model="smollm2", max_tokens=8, system="Be brief.", messages=[{"role": "user", "content": "Say hello."}]
    )
    assert out.type == "message" and out.role == "assistant" and out.model == "smollm2"
    assert out.content[0].type == "text" and out.content[0].text  # type: ignore[union-attr]
    assert out.stop_reason in ("end_turn", "max_tokens")
    assert 0 < out.usage.output_tokens <= 8 and out.usage.input_tokens > 0


def test_a_streamed_message_from_the_engine(engine: Gateway) -> None:
    with client(engine).messages.stream(
        model="smollm2", max_tokens=12, messages=[{"role": "user", "content": "Count to five."}]
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
        text = "".join(block.text for block in final.content if block.type == "text")
    assert events[0] == "message_start" and events[-1] == "message_stop"
    for kind in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta"):
        assert kind in events
    assert text and final.stop_reason in ("end_turn", "max_tokens")


def test_the_request_reaches_the_engine_as_chat(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(SCRIPTED)
    out = client(gw).messages.create(
        model="echo",
        max_tokens=5,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "What is the weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ],
        tools=[{"name": "weather", "description": "d", "input_schema": {"type": "object", "properties": {}}}],
        tool_choice={"type": "any"},
        stop_sequences=["END"],
        thinking={"type": "disabled"},
        metadata={"user_id": "u1"},
        extra_body={"temperature": 0.5, "top_k": 7},  # older clients' fields, which this SDK no longer has
    )
    sent = json.loads(out.content[0].text)  # type: ignore[union-attr]
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "tool"]
    assert sent["messages"][2]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert sent["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert sent["tools"][0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert sent["tool_choice"] == "required" and sent["stop"] == ["END"] and sent["max_tokens"] == 5
    assert sent["temperature"] == 0.5 and sent["top_k"] == 7 and sent["user"] == "u1"
    assert sent["reasoning_effort"] == "minimal"


def test_text_blocks_reach_the_engine_as_a_string_and_a_stream_counts_the_input(
    gateway: Callable[..., Gateway],
) -> None:
    gw = gateway(SCRIPTED)
    blocks = [{"type": "text", "text": "how are"}, {"type": "text", "text": "you"}]
    out = client(gw).messages.create(model="echo", max_tokens=5, messages=[{"role": "user", "content": blocks}])
    # one string, not a list of parts: many engines' chat templates (llama.cpp's) take no list
    assert json.loads(out.content[0].text)["messages"] == [{"role": "user", "content": "how are\nyou"}]  # type: ignore[union-attr]
    with client(gw).messages.stream(
        model="cheap", max_tokens=5, messages=[{"role": "user", "content": blocks}]
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.input_tokens == 3 and final.usage.output_tokens == 2  # message_delta's counts


CASCADE = (
    SCRIPTED
    + """virtual_models:
  auto: {type: cascade, open: echo}
cascade:
  tiers:
    - {name: pool, type: model, model: cheap, logprobs: false, assumed_confidence: 0.7}
"""
)


def test_an_output_format_to_a_cascade_model_is_a_typed_decision(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(CASCADE.replace('text: "fine thanks"', 'text: "yes"'))
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
    out = client(gw).messages.create(
        model="auto",
        max_tokens=8,
        messages=[{"role": "user", "content": "Is the sun a star?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
    )
    assert out.content[0].text == '{"answer":true}'  # type: ignore[union-attr]
    assert out.model_extra["triage"]["tier"] == "pool"  # type: ignore[index]
    with client(gw).messages.stream(
        model="auto",
        max_tokens=8,
        messages=[{"role": "user", "content": "Is the sun a star?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    ) as stream:
        assert stream.get_final_message().content[0].text == '{"answer":true}'  # type: ignore[union-attr]


def test_the_key_goes_in_x_api_key_and_errors_are_anthropics(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(SCRIPTED + f"keys:\n  - {{name: app, sha256: {hashlib.sha256(KEY.encode()).hexdigest()}}}\n")
    ok = client(gw, KEY).messages.create(model="cheap", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert ok.content[0].text == "fine thanks"  # type: ignore[union-attr]
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client(gw, "wrong").messages.create(model="cheap", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client(gw, KEY).messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": missing.value.body["error"]["message"]},
    }  # type: ignore[index]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "cheap", "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
        {"model": "cheap", "max_tokens": 4, "messages": []},
        {"model": "cheap", "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]},
        {"model": "cheap", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
        {"model": "cheap", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5},
        {"model": "cheap", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "x"}},
    ],
)
def test_bad_requests_are_400_in_anthropics_shape(gateway: Callable[..., Gateway], body: dict) -> None:
    gw = gateway(SCRIPTED)
    with gw.http() as http:
        r = http.post("/v1/messages", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        again = http.post(
            "/v1/messages", json={"model": "cheap", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert again.status_code == 200


def test_a_stream_cut_by_the_engine_ends_with_the_error_event(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(SCRIPTED)
    with gw.http() as http:
        r = http.post(
            "/v1/messages",
            json={"model": "broken", "max_tokens": 20, "stream": True, "messages": [{"role": "user", "content": "x"}]},
        )
    kinds = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and "content_block_delta" in kinds
    assert kinds[-1] == "error" and "message_stop" not in kinds
