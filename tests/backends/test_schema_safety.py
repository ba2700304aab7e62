"""Schemas a local engine cannot survive (issue 51, hardening round three): each reproduction of
the issue is a 400 in the API's own shape naming the field, on every surface a schema reaches a
local engine by (a response format on chat, Responses and Messages; a forced tool's parameters on
the three; Batch API lines), and the engine's worker does not restart. ``test_schema_fuzz.py``
shows, past the check, that the worker dies on them."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest

from backends import gbnf
from tests import lanes
from tests.conftest import Gateway, GatewayRunner

SHORT = [{"role": "user", "content": "What is 2 + 2?"}]

# (schema, the field the 400 names, under the schema's own path)
CRASHERS = [
    ({"enum": []}, "enum"),
    ({"anyOf": []}, "anyOf"),
    ({"type": []}, "type"),
    ({"type": "object", "additionalProperties": {"enum": []}}, "additionalProperties.enum"),
    ({"enum": ["a\x00b"]}, "enum"),
    ({"const": "\x00"}, "const"),
    ({"type": "string", "maxLength": 10000}, "maxLength"),
    ({"type": "string", "pattern": "^a]$"}, "pattern"),  # found by the fuzzer: the converter loops for ever
    ({"type": "string", "pattern": "^(ab){0,200000000}$"}, "pattern"),  # the converter writes gigabytes
]
CRASHER_IDS = ["empty-enum", "empty-anyOf", "empty-type", "empty-enum-inside", "nul-enum", "nul-const", "maxLength"]
CRASHER_IDS += ["stray-bracket", "pattern-count"]
BOOLEANS = [
    ({"anyOf": [False]}, "anyOf[0]"),
    ({"anyOf": [True]}, "anyOf[0]"),
    ({"oneOf": [True, {"type": "string"}]}, "oneOf[0]"),
    ({"type": "array", "items": True}, "items"),
    ({"type": "array", "items": False}, "items"),
    ({"type": "object", "properties": {"a": True}}, "properties.a"),
    ({"allOf": [False]}, "allOf[0]"),
    ({"prefixItems": [True]}, "prefixItems[0]"),
    ({"$defs": {"a": False}, "$ref": "#/$defs/a"}, "$defs.a"),
]
HUGE_ENUM = ({"enum": [f"value {i}" for i in range(3000)]}, "enum")


def chat_format(schema: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {
        "model": "smollm2",
        "messages": SHORT,
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def surfaces(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, the schema's path as the local backend names it) for a response format and a
    forced tool on each surface."""
    fmt, tool = "response_format.json_schema.schema", "tools[0].function.parameters"
    return [
        (*chat_format(schema), fmt),
        (
            "/v1/responses",
            {
                "model": "smollm2",
                "input": "hi",
                "max_output_tokens": 2,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
            },
            fmt,
        ),
        (
            "/v1/messages",
            {
                "model": "smollm2",
                "max_tokens": 2,
                "messages": SHORT,
                "output_config": {"format": {"type": "json_schema", "schema": schema}},
            },
            fmt,
        ),
        (
            "/v1/chat/completions",
            {
                "model": "smollm2",
                "messages": SHORT,
                "max_tokens": 2,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            tool,
        ),
        (
            "/v1/responses",
            {
                "model": "smollm2",
                "input": "hi",
                "max_output_tokens": 2,
                "tools": [{"type": "function", "name": "f", "parameters": schema}],
                "tool_choice": {"type": "function", "name": "f"},
            },
            tool,
        ),
        (
            "/v1/messages",
            {
                "model": "smollm2",
                "max_tokens": 2,
                "messages": SHORT,
                "tools": [{"name": "f", "input_schema": schema}],
                "tool_choice": {"type": "tool", "name": "f"},
            },
            tool,
        ),
    ]


@pytest.fixture(scope="module")
@lanes.engine
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    from tests.backends.test_engines import POLICY

    tmp = tmp_path_factory.mktemp("schema-safety")
    runner = GatewayRunner(tmp)
    yield runner.start(POLICY + f'batches: {{dir: "{tmp / "b"}", concurrency: 4}}\n')
    runner.stop_all()


def refused_everywhere(gw: Gateway, schema: dict[str, Any], field: str, ways: slice = slice(None)) -> None:
    from tests.backends.test_engines import host_of

    host = host_of(gw)
    pid, before = host.pid, host.restarts
    with gw.http() as http:
        for path, body, where in surfaces(schema)[ways]:
            resp = http.post(path, json=body)
            assert resp.status_code == 400, (path, where, resp.text[:300])
            error = resp.json()["error"]
            assert f"{where}.{field}" in error["message"], (path, error)
            if path != "/v1/messages":  # Anthropic's error shape has no param
                assert error["param"] == f"{where}.{field}", (path, error)
                assert error["code"] == "schema_out_of_bounds", error
        assert http.get("/health").status_code == 200
    assert host.pid == pid and host.restarts == before  # refused before it reached the engine


@pytest.mark.parametrize(("schema", "field"), CRASHERS, ids=CRASHER_IDS)
def test_a_schema_that_crashed_the_engine_is_a_400_naming_the_field_on_every_surface(
    local: Gateway, schema: dict[str, Any], field: str
) -> None:
    refused_everywhere(local, schema, field)


@pytest.mark.parametrize(("schema", "field"), BOOLEANS, ids=[json.dumps(s) for s, _ in BOOLEANS])
def test_a_boolean_sub_schema_is_a_400_not_a_500(local: Gateway, schema: dict[str, Any], field: str) -> None:
    refused_everywhere(local, schema, field)


def test_an_enum_of_thousands_of_values_is_a_400_and_one_within_the_bound_is_served(local: Gateway) -> None:
    """3,000 values held the engine past its deadline (each value a grammar stack walked every token)."""
    from backends.base import Call
    from backends.llamacpp import _kwargs
    from backends.schema_bounds import MAX_ALTERNATIVES, check
    from policies.errors import InvalidRequest

    refused_everywhere(local, *HUGE_ENUM, ways=slice(0, 3))  # as tools, the gateway counts it past the context first
    with pytest.raises(InvalidRequest) as refused:
        _kwargs(Call("chat", surfaces(HUGE_ENUM[0])[3][1], "r"))
    assert refused.value.param == "tools[0].function.parameters.enum"
    check({"enum": [f"value {i}" for i in range(MAX_ALTERNATIVES)]})  # the bound itself passes
    path, body = chat_format({"enum": [f"v{i}" for i in range(100)]})  # what SmolLM2's 1,024-token context holds
    with local.http() as http:
        resp = http.post(path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text[:300]


def test_a_forced_tool_within_the_bounds_is_served(local: Gateway) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    path, body, _ = surfaces(schema)[3]
    with local.http() as http:
        resp = http.post(path, json={**body, "max_tokens": 4})
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"


def test_batch_lines_with_crashing_schemas_get_400_lines_and_the_others_are_answered(local: Gateway) -> None:
    from tests.backends.test_engines import host_of
    from tests.batch.test_batches import jsonl, wait_batch

    host = host_of(local)
    before = host.restarts
    schemas = {"bad-enum": {"enum": []}, "bad-nul": {"const": "\x00"}, "ok-1": {"type": "boolean"}}
    schemas |= {"ok-2": {"type": "integer"}, "ok-3": {"enum": ["yes", "no"]}}
    lines = [
        json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": chat_format(s)[1]})
        for cid, s in schemas.items()
    ]
    client = local.client()
    f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_batch(client, batch.id, timeout=120)
    assert batch.status == "completed", batch
    errors = {e["custom_id"]: e for e in (jsonl(client, batch.error_file_id) if batch.error_file_id else [])}
    out = {o["custom_id"]: o for o in (jsonl(client, batch.output_file_id) if batch.output_file_id else [])}
    for cid in ("bad-enum", "bad-nul"):
        line = errors.get(cid) or out[cid]
        assert line["response"]["status_code"] == 400, line
        assert line["response"]["body"]["error"]["code"] == "schema_out_of_bounds", line
    for cid in ("ok-1", "ok-2", "ok-3"):
        assert out[cid]["response"]["status_code"] == 200, (cid, out.get(cid), errors.get(cid))
    assert host.restarts == before


@pytest.mark.engine  # llama-cpp-python's converter
def test_a_lone_surrogate_anywhere_in_a_schema_is_refused_before_the_wire() -> None:
    """The JSON parsers of the HTTP edge refuse one; a schema from the library would otherwise
    fail to cross the pipe to the worker."""
    from backends.base import Call
    from backends.llamacpp import _kwargs
    from policies.errors import InvalidRequest

    _, body = chat_format({"type": "object", "properties": {"a": {}}, "required": ["\ud800"]})
    with pytest.raises(InvalidRequest) as refused:
        _kwargs(Call("chat", body, "r"))
    assert refused.value.param == "response_format.json_schema.schema"


# --- the grammar reader (pure: no engine) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= \nspace ::= " "?',  # the converter's empty enum: the rule reads the next line's name
        'root ::= "a" | b',  # an undefined rule
        'root ::= root "a"',  # left recursion
        'root ::= x\nx ::= ( "" )? root',  # left recursion through an optional group
        'root ::= "\\x00"',  # a character no token holds
        'root ::= "a\\ud800"',
        'root ::= "a"{5,3}',  # a maximum under the minimum: llama.cpp would loop
        'root ::= "a"{3000}',  # past llama.cpp's repetition threshold
        "root ::= <[12]>",  # token references
        'root ::= "a"\x00',
    ],
)
def test_the_grammar_reader_refuses_what_llama_cpp_cannot_survive(grammar: str) -> None:
    with pytest.raises(gbnf.GrammarRefused):
        gbnf.read(grammar, 512)


def test_the_grammar_reader_reads_what_the_converter_writes() -> None:
    read = gbnf.read('root ::= "{" space (a | "b"*)? [^"\\\\] "}"\nspace ::= " "?\na ::= [0-9]{1,3} ("," a)*', 512)
    assert read.depth == 1 and read.widest == 2
    assert set(read.symbols) >= {"root", "space", "a"}
    with pytest.raises(gbnf.TooDeep):
        gbnf.read("root ::= " + "(" * 40 + '"a"' + ")" * 40, 30)
