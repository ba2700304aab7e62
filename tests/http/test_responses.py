"""``/v1/responses`` through the official openai client: against a real llama.cpp engine (plain,
streamed, a stored conversation), a cascade model given a JSON-schema format, and the errors."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from tests.conftest import Gateway, LlamaServer
from tests.http.test_openai_surface import pool_policy

EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture
def gw(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> Gateway:
    return gateway(pool_policy(llama_server.api_base))


def test_a_response_from_the_engine(gw: Gateway) -> None:
    out = gw.client().responses.create(
        model="smollm2", input="Say hello.", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert out.object == "response" and out.id.startswith("resp_") and out.model == "smollm2"
    assert out.output_text and out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.usage is not None and 0 < out.usage.output_tokens <= 8 and out.usage.input_tokens > 0
    assert out.status in ("completed", "incomplete")
    if out.status == "incomplete":
        assert out.incomplete_details is not None and out.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_response_has_the_event_sequence(gw: Gateway) -> None:
    with gw.client().responses.stream(model="smollm2", input="Count to five.", max_output_tokens=12) as stream:
        events = list(stream)
    # the last event carries the response: response.completed, or response.incomplete when the
    # engine stopped at max_output_tokens (as OpenAI's; the SDK's get_final_response wants the first)
    final = events[-1].response  # type: ignore[union-attr]
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert [k for k in dict.fromkeys(kinds) if k in EVENTS] == EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text  # no usage: llama-cpp-python's server sends none when streaming


def test_a_stored_response_carries_the_conversation(gw: Gateway) -> None:
    client = gw.client()
    first = client.responses.create(model="smollm2", input="My name is Ada.", max_output_tokens=8)
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    second = client.responses.create(model="smollm2", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8)  # fmt: skip
    assert second.previous_response_id == first.id and second.output_text
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the earlier turn was sent again
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smollm2", input="x", previous_response_id=first.id)
    unstored = client.responses.create(model="smollm2", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


CASCADE = """version: 1
backends:
  cheap: {type: scripted, text: "B"}
  echo: {type: scripted, echo: true}
  broken: {type: scripted, text: "one two three four five six", chunks: 6, die_after_chunks: 2}
models:
  cheap: {backend: cheap}
  echo: {backend: echo}
  broken: {backend: broken}
virtual_models:
  auto: {type: cascade, open: echo}
cascade:
  tiers:
    - {name: pool, type: model, model: cheap, logprobs: false, assumed_confidence: 0.7}
"""


def test_a_json_schema_format_to_a_cascade_model_is_a_typed_decision(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(CASCADE)
    schema = {"type": "object", "properties": {"answer": {"enum": ["red", "green", "blue"]}}, "required": ["answer"]}
    fmt = {"format": {"type": "json_schema", "name": "colour", "schema": schema}}
    out = gw.client().responses.create(model="auto", input="Which colour is grass?", text=fmt)  # type: ignore[arg-type]
    assert out.output_text == '{"answer":"green"}'
    decision = out.model_extra["triage"]  # type: ignore[index]
    assert decision["tier"] == "pool" and decision["probabilities_measured"] is False
    with gw.client().responses.stream(model="auto", input="Which colour is grass?", text=fmt) as stream:  # type: ignore[arg-type]
        assert stream.get_final_response().output_text == '{"answer":"green"}'


def test_a_streamed_response_carries_the_engines_usage(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(CASCADE)
    with gw.client().responses.stream(model="cheap", input="x") as stream:
        final = stream.get_final_response()
    assert final.output_text == "B" and final.usage is not None and final.usage.output_tokens > 0


def test_the_request_reaches_the_engine_as_chat(gateway: Callable[..., Gateway]) -> None:
    import json

    gw = gateway(CASCADE)
    tool = {
        "type": "function",
        "name": "lookup",
        "description": "d",
        "parameters": {"type": "object", "properties": {}},
    }
    out = gw.client().responses.create(
        model="echo",
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Look it up."}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
        tools=[tool],  # type: ignore[list-item]
        tool_choice="auto",
        reasoning={"effort": "low"},
        max_output_tokens=5,
        temperature=0.2,
        top_p=0.9,
    )
    sent = json.loads(out.output_text)
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "tool"]
    assert sent["messages"][1] == {"role": "user", "content": "Look it up."}  # text parts: a string, for any template
    assert sent["messages"][2]["tool_calls"][0]["function"]["name"] == "lookup"
    assert sent["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    assert sent["tools"][0] == {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    assert sent["max_tokens"] == 5 and sent["reasoning_effort"] == "low" and sent["tool_choice"] == "auto"
    assert sent["temperature"] == 0.2 and sent["top_p"] == 0.9


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "input": "x"}, 404, "model"),
        ({"model": "echo"}, 400, "input"),
        ({"model": "echo", "input": []}, 400, "input"),
        ({"model": "echo", "input": [{"type": "reasoning"}]}, 400, "input.0.type"),
        ({"model": "echo", "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0"),
        ({"model": "echo", "input": "x", "background": True}, 400, "background"),
        (
            {"model": "echo", "input": "x", "text": {"format": {"type": "json_schema", "schema": "x"}}},
            400,
            "text.format",
        ),
        ({"model": "echo", "input": "x", "previous_response_id": "resp_missing"}, 404, None),
        ({"model": "echo", "input": "x", "temperature": 5}, 400, "temperature"),
    ],
)
def test_bad_requests_get_the_apis_error_and_the_server_keeps_serving(
    gateway: Callable[..., Gateway], body: dict, status: int, param: str | None
) -> None:
    gw = gateway(CASCADE)
    with gw.http() as http:
        r = http.post("/v1/responses", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"].get("param") == param
        assert http.post("/v1/responses", json={"model": "echo", "input": "ok"}).status_code == 200


def test_a_stream_cut_by_the_engine_ends_with_the_error_event(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(CASCADE)
    with gw.http() as http:
        r = http.post("/v1/responses", json={"model": "broken", "input": "x", "stream": True})
    assert r.status_code == 200
    kinds = [line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event: ")]
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds
