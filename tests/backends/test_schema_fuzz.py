"""The differential schema fuzzer (issue 51): generated JSON schemas, valid ones of every keyword
llama-cpp-python's converter reads and hostile ones (empty alternatives, NUL and control
characters, quotes, boolean sub-schemas, huge enums, deep nesting, references that loop), each as
a response format or as a forced tool's parameters. Every one the local backend's check accepts
(``backends.llamacpp``, which runs ``backends.schema_bounds``) goes to the real engine in its worker
process (SmolLM2, two tokens); a worker death, or a job held past its deadline, fails the run.

A sample in the normal suite; ``make fuzz`` runs ``SCHEMA_FUZZ_EXAMPLES`` (docs/operations.md,
'Fuzzing', has the count and the time of a run).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.base import Call
from backends.engine_handle import EngineHandle
from backends.engine_host import EngineSpec
from backends.gguf import smollm2_path
from backends.llamacpp import _kwargs
from policies.errors import EngineCrashed, InvalidRequest, UpstreamError, UpstreamTimeout
from tests import lanes

EXAMPLES = int(os.environ.get("SCHEMA_FUZZ_EXAMPLES", "500"))
DEADLINE_S = 30.0  # a schema whose two tokens take longer than this fails the run too
CHECK_S = 10.0  # and a check that takes longer than this (llama-cpp-python's converter can loop for ever)

# --- the schemas -------------------------------------------------------------------------------------------

ODD = list("\x00\x01\x08\x0c\x1f\n\r\t\"\\'-[]{}()|^$.*+?/\u2028\ud800\U0001f600")
TEXT = st.text(st.characters() | st.sampled_from(ODD), max_size=10)
NAMES = st.from_regex(r"[a-z]{1,6}", fullmatch=True) | TEXT
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
COUNTS = (
    st.integers(0, 6)
    | st.sampled_from([0, 1, 64, 500, 1000, 2000, 4096, 4097, 10_000, -1])
    | st.sampled_from([1.5, True])
)
PIECES = ["a", "b", "[a-z]", "[^a]", "\\d", "\\w", "\\s", ".", "(", ")", "|", "*", "+", "?", "{2}", "{1,3}", "{0,}"]
PIECES += ["\\x00", "\\u0000", "\\.", '"', "\\\\", "[]", "[^]", "\\b", "\\f", "é", "(?:", "a{3000}", "\\n", "-", "]"]
PATTERNS = st.builds(
    lambda start, body, end: start + "".join(body) + end,
    st.sampled_from(["^", ""]),
    st.lists(st.sampled_from(PIECES), max_size=8),
    st.sampled_from(["$", ""]),
)
TYPES = st.sampled_from(["string", "number", "integer", "boolean", "null", "object", "array", "any", "str"])
FORMATS = st.sampled_from(["date", "time", "date-time", "uuid", "uuid4", "email", "uri", ""])
REFS = st.sampled_from(["#/$defs/d0", "#/$defs/d1", "#/definitions/x", "#/properties", "#/$defs", "other.json"])


def _enum_of(n: int) -> dict[str, Any]:
    return {"enum": [f"v{i}" for i in range(n)]}


LEAVES = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={"minLength": COUNTS, "maxLength": COUNTS, "pattern": PATTERNS, "format": FORMATS},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["integer", "number"])},
        optional={"minimum": st.integers(-100, 100), "maximum": st.integers(-100, 100), "multipleOf": st.just(2)},
    ),
    st.builds(lambda t: {"type": t}, TYPES),
    st.builds(lambda ts: {"type": ts}, st.lists(TYPES, max_size=3)),
    st.builds(lambda v: {"enum": v}, st.lists(JSON, max_size=5)),
    st.builds(_enum_of, st.sampled_from([0, 1, 2, 1024, 1025, 3000])),
    st.builds(lambda v: {"const": v}, JSON),
    st.builds(lambda f: {"format": f}, FORMATS),
    st.builds(lambda r: {"$ref": r}, REFS),
    st.just({}),
    st.booleans(),  # a boolean sub-schema
)


def _object(props: dict[str, Any], required: list[str], extra: dict[str, Any], typed: bool) -> dict[str, Any]:
    return {**({"type": "object"} if typed else {}), "properties": props, "required": required, **extra}


def _composites(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(
            _object,
            st.dictionaries(NAMES, inner, max_size=4),
            st.lists(NAMES, max_size=3),
            st.fixed_dictionaries(
                {}, optional={"additionalProperties": st.booleans() | inner, "minProperties": COUNTS}
            ),
            st.booleans(),
        ),
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": inner | st.lists(inner, max_size=3)},
            optional={"minItems": COUNTS, "maxItems": COUNTS, "uniqueItems": st.booleans()},
        ),
        st.builds(lambda items: {"prefixItems": items}, st.lists(inner, max_size=3)),
        st.builds(lambda k, v: {k: v}, st.sampled_from(["anyOf", "oneOf", "allOf"]), st.lists(inner, max_size=4)),
        st.builds(lambda a, b: {"allOf": [a, {"anyOf": [b]}]}, inner, inner),
    )


INNER = st.recursive(LEAVES, _composites, max_leaves=10)


def _deep(depth: int, how: str) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        node = (
            {"type": "array", "items": node, "maxItems": 2}
            if how == "array"
            else {"anyOf": [node]}
            if how == "anyOf"
            else {"type": "object", "properties": {"a": node}, "required": ["a"]}
        )
    return node


def _root(body: Any, defs: dict[str, Any]) -> dict[str, Any]:
    root = body if isinstance(body, dict) else {"type": "object", "properties": {"x": body}}
    return {**root, "$defs": defs} if defs else root


SCHEMAS = st.one_of(
    st.builds(_root, INNER, st.dictionaries(st.sampled_from(["d0", "d1"]), INNER, max_size=2)),
    st.builds(_deep, st.integers(1, 120), st.sampled_from(["array", "anyOf", "object"])),
)


# --- the engine --------------------------------------------------------------------------------------------


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    deaths: list[str] = field(default_factory=list)  # the schemas (JSON, cut) that crashed or hung the worker or check
    seconds: float = 0.0


class Bench:
    """SmolLM2's chat engine in its worker process, and a loop to drive it from the test's thread."""

    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.handle = self.runner.run(self._open())

    @staticmethod
    async def _open() -> EngineHandle:
        handle = EngineHandle("schema-fuzz", smollm2_path(), EngineSpec("chat", 512, 1, 512))  # the loop's host
        await handle.open()
        return handle

    def close(self) -> None:
        self.runner.run(self.handle.host.stop())
        self.runner.close()

    def send(self, args: dict[str, Any]) -> str:
        """What became of one request's arguments in the engine: served, invalid (the worker's 400),
        crashed, slow."""
        try:
            self.runner.run(self.handle.call("chat", args, DEADLINE_S))
        except EngineCrashed:
            return "crashed"
        except UpstreamTimeout:
            return "slow"
        except InvalidRequest:
            return "invalid"
        except UpstreamError:
            return "crashed"  # a worker that died while the job waited is an engine error too
        return "served"


def body_for(schema: dict[str, Any], as_tool: bool, temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 2,
        "temperature": temperature,
        "seed": 7,
    }
    if as_tool:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = {"type": "function", "function": {"name": "f"}}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return body


class CheckHung(Exception):
    pass


def _hung(signum: int, frame: Any) -> None:
    raise CheckHung


def run_one(bench: Bench, tally: Tally, schema: dict[str, Any], as_tool: bool, temperature: float) -> None:
    if sum(tally.outcomes.values()) % 1000 == 999:
        print(f"schema fuzz: {sum(tally.outcomes.values()) + 1} schemas, {dict(tally.outcomes)}", flush=True)
    previous = signal.signal(signal.SIGALRM, _hung)  # the check is pure Python: an endless loop there is caught
    signal.setitimer(signal.ITIMER_REAL, CHECK_S)
    try:
        args = _kwargs(Call("chat", body_for(schema, as_tool, temperature), "schema-fuzz"))
    except InvalidRequest:
        tally.outcomes["refused"] += 1
        return
    except CheckHung:
        tally.outcomes["hung check"] += 1
        tally.deaths.append(f"the check ran past {CHECK_S:g}s: {json.dumps(schema)[:400]}")
        return
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    started = time.monotonic()
    got = bench.send(args)
    tally.seconds += time.monotonic() - started
    tally.outcomes[got] += 1
    if got in ("crashed", "slow"):
        tally.deaths.append(f"{got} {'tool' if as_tool else 'format'}: {json.dumps(schema)[:400]}")


@pytest.fixture(scope="module")
@lanes.engine
def bench() -> Iterator[Bench]:
    b = Bench()
    yield b
    b.close()


def test_no_schema_the_check_accepts_kills_the_engine(bench: Bench) -> None:
    """EXAMPLES generated schemas: each refused by the check (a 400 at the edge) or run through the
    engine without a worker death."""
    tally = Tally()
    restarts = bench.handle.host.restarts
    started = time.monotonic()

    @given(schema=SCHEMAS, as_tool=st.booleans(), temperature=st.sampled_from([0.0, 1.0]))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def fuzz(schema: dict[str, Any], as_tool: bool, temperature: float) -> None:
        run_one(bench, tally, schema, as_tool, temperature)

    fuzz()
    elapsed = time.monotonic() - started
    print(
        f"\nschema fuzz: {sum(tally.outcomes.values())} schemas in {elapsed:.0f}s "
        f"({tally.seconds:.0f}s in the engine): {dict(tally.outcomes)}"
    )
    assert not tally.deaths, tally.deaths[:10]
    assert bench.handle.host.restarts == restarts
    assert tally.outcomes["served"] > 0 and tally.outcomes["refused"] > 0, tally.outcomes


@pytest.mark.parametrize(
    "schema",
    [{"enum": []}, {"type": "object", "additionalProperties": {"enum": []}}, {"const": "\x00"}],
    ids=["empty-enum", "empty-enum-inside", "nul-const"],
)
def test_the_bench_sees_a_death_the_check_would_have_prevented(bench: Bench, schema: dict[str, Any]) -> None:
    """The fuzzer is not blind: a reproduction sent past the check kills the worker (this is why
    the check refuses it), the bench says so, and the next request is served by its successor."""
    args = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "model": "smollm2"}
    args["response_format"] = {"type": "json_object", "schema": schema}
    restarts = bench.handle.host.restarts
    assert bench.send(args) == "crashed"
    assert bench.handle.host.restarts == restarts + 1
    plain = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "model": "smollm2"}
    assert bench.send(plain) == "served"
