"""Tool-call arguments that are no JSON (what a weak model without a grammar may emit), from a
scripted engine on every surface: passed on as the engine gave them and flagged, never a 500;
valid ones are not flagged (the engines' tool calls are in ``test_tool_calls.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import structlog

from tests.conftest import Gateway
from tests.http.test_tool_calls import (
    CHAT_TOOL,
    MESSAGES_TOOL,
    QUESTION,
    RESPONSES_TOOL,
    claude,
    only_call,
    only_tool_use,
)
from tests.service.test_router_serving import toy  # noqa: F401 - fixture: the learned router's quality head

# --- arguments that are no JSON (a scripted engine) -----------------------------------------------

BAD = '{"city": Paris'  # what a weak model without a grammar may emit


def scripted_policy() -> str:
    return f"""version: 1
backends:
  sloppy: {{type: scripted, chunks: 3, tool_call: {{name: get_weather, arguments: {json.dumps(BAD)}}}}}
models:
  sloppy: {{backend: sloppy}}
"""


def flagged(logs: list[Any]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "tool_arguments_invalid"]


def test_arguments_that_are_no_json_are_passed_on_and_flagged_never_a_500(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(scripted_policy())
    client = gw.client()
    asked: list[Any] = [{"role": "user", "content": QUESTION}]
    with structlog.testing.capture_logs() as logs:
        # chat: the string as the engine gave it, whole and streamed
        got = client.chat.completions.create(model="sloppy", messages=asked, tools=[CHAT_TOOL])
        call = only_call(got.choices[0].message)
        assert call.function.arguments == BAD and got.choices[0].finish_reason == "tool_calls"
        pieces = [
            d.function.arguments or ""
            for chunk in client.chat.completions.create(model="sloppy", messages=asked, tools=[CHAT_TOOL], stream=True)
            for choice in chunk.choices
            for d in choice.delta.tool_calls or []
            if d.function
        ]
        assert "".join(pieces) == BAD and len(pieces) > 1
        # Responses: the string intact in the item and in the events (the SDK's stream helper parses a
        # strict tool's arguments at the end, and raises on these: a strict tool is one the engine
        # decodes under its schema, which a gateway cannot check, so this one is not strict)
        loose: Any = {**RESPONSES_TOOL, "strict": False}
        item = client.responses.create(model="sloppy", input=QUESTION, tools=[loose]).output[0]
        assert item.type == "function_call" and item.arguments == BAD
        with client.responses.stream(model="sloppy", input=QUESTION, tools=[loose]) as stream:
            [done] = [e for e in stream if e.type == "response.function_call_arguments.done"]
        assert done.arguments == BAD
        # Messages: input is an object, so the string is kept under _raw, whole and streamed (the
        # SDK's stream accumulator parses every input_json_delta: what it gets is JSON)
        with claude(gw) as c:
            msg = c.messages.create(model="sloppy", max_tokens=16, messages=asked, tools=[MESSAGES_TOOL])
            with c.messages.stream(model="sloppy", max_tokens=16, messages=asked, tools=[MESSAGES_TOOL]) as s:
                final = s.get_final_message()
        assert only_tool_use(msg.content).input == {"_raw": BAD}
        assert msg.stop_reason == "tool_use"
        assert only_tool_use(final.content).input == {"_raw": BAD}
    events = flagged(logs)
    assert len(events) == 6, events  # one per answer: chat, Responses and Messages, whole and streamed
    assert {e["tool"] for e in events} == {"get_weather"} and {e["arguments_bytes"] for e in events} == {len(BAD)}
    assert all(e["model"] == "sloppy" and e["backend"] == "sloppy" and e["request_id"] for e in events)
    assert not any(BAD in json.dumps(e) for e in events)  # the model's text is not logged


def test_valid_arguments_are_not_flagged(gateway: Callable[..., Gateway]) -> None:
    text = scripted_policy().replace(json.dumps(BAD), json.dumps('{"city": "Paris"}'))
    gw = gateway(text)
    with structlog.testing.capture_logs() as logs:
        r = httpx.post(
            f"{gw.base_url}/v1/messages",
            json={
                "model": "sloppy",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [MESSAGES_TOOL],
                "stream": True,
            },
            timeout=30,
        )
    assert r.status_code == 200 and not flagged(logs)
    partial = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    deltas = [e["delta"]["partial_json"] for e in partial if e["type"] == "content_block_delta"]
    assert deltas == ['{"city": "Paris"}']  # one delta, when the call is whole
