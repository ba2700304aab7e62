"""The JSON schemas a local llama.cpp engine survives, checked before one reaches it.

llama-cpp-python turns a ``json_schema`` response format into a GBNF grammar, and llama.cpp
parses that grammar recursively: an optional run (``maxLength`` minus ``minLength`` characters,
``maxItems`` minus ``minItems`` items) becomes that many nested groups, and past about a
thousand of them the parser overflows its stack (SIGSEGV). Measured on SmolLM2 through the
worker (llama-cpp-python 0.3.36, AMD EPYC with AVX-512 VNNI, 2026-12-03, a one-off script): ``maxLength`` 1,000 and
``maxItems`` 1,000 serve, 2,000 and 10,000 kill the process; ``minItems`` = ``maxItems`` = 1,000
(flat, 15 deep) serves. The bounds below keep a factor of two under the first crash. The worker
process keeps a schema beyond them from taking the gateway down in any case; this check turns
it into a 400 naming the keyword, before it costs a restart.

Pure: the schema's numbers, then the grammar it compiles to (llama-cpp-python's converter, pure
Python), are read; nothing runs on an engine.
"""

from __future__ import annotations

import json
from typing import Any

MAX_COUNT = 4096  # any length or count keyword of the schema
MAX_NESTING = 512  # groups inside groups in the compiled grammar
MAX_GRAMMAR_BYTES = 256 * 1024
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


class SchemaOutOfBounds(ValueError):
    """A schema the local engine cannot take; the message names the keyword and where."""


def _counts(node: Any, where: str) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _COUNTS and isinstance(value, int | float) and value > MAX_COUNT:
                raise SchemaOutOfBounds(f"{where}.{key} is {value:g}; the local engine takes at most {MAX_COUNT}")
            _counts(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _counts(value, f"{where}[{i}]")


# The escapes the GBNF parser of llama-cpp-python 0.3.36's llama.cpp reads (tried one by one on
# SmolLM2: these parse; ``\\.``, ``\\/``, ``\\f`` do not). Any other makes the parse fail, and
# llama-cpp-python then samples with no grammar: SIGSEGV. Its converter writes such escapes for a
# form feed or backspace in an ``enum`` or ``const`` (``\\f``, ``\\b``; found by the fuzz suite)
# and for a regex escape it does not translate in a ``pattern`` (``\\d``, ``\\.``).
ESCAPES = frozenset('xuUtrn\\"[]-')
# What GBNF has outside literals and character classes: rule names, ``::=``, alternatives, groups,
# repetitions. Anything else there means a literal closed early: llama-cpp-python's converter
# writes an ``enum`` value holding ``"`` so (its literal ends at the quote, the rest is garbage).
_BARE = frozenset('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_ \t\r\n:=|()*+?{},."[')


def nesting(grammar: str) -> int:
    """The deepest nesting of groups in a GBNF grammar (literals and character classes skipped);
    SchemaOutOfBounds for what llama.cpp's parser does not read (an escape, a stray character, an
    open literal at the end)."""
    depth = deepest = 0
    quote: str | None = None  # inside "..." or [...]
    escaped = False
    for i, ch in enumerate(grammar):
        if quote is not None:
            if escaped:
                escaped = False
                if ch not in ESCAPES:
                    raise SchemaOutOfBounds(
                        f"the grammar has the escape \\{ch} (near {grammar[max(0, i - 30) : i + 10]!r}), which the "
                        "local engine cannot read: a control character in an enum or const, or a pattern escape?"
                    )
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch not in _BARE:
            raise SchemaOutOfBounds(
                f"the grammar does not parse at {grammar[max(0, i - 30) : i + 10]!r} (the converter's output for "
                "a quote or a backslash in an enum or const value?); the local engine cannot take it"
            )
        elif ch == '"':
            quote = '"'
        elif ch == "[":
            quote = "]"
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    if quote is not None:
        raise SchemaOutOfBounds("the grammar ends inside a literal; the local engine cannot take it")
    return deepest


def check(schema: dict[str, Any], where: str = "schema") -> str:
    """The grammar the schema compiles to, or SchemaOutOfBounds saying which bound it passes."""
    _counts(schema, where)
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        grammar = json_schema_to_gbnf(json.dumps(schema))
    except (ValueError, TypeError, KeyError, AssertionError, RecursionError) as exc:
        raise SchemaOutOfBounds(f"{where}: the local engine cannot turn it into a grammar: {exc}") from None
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise SchemaOutOfBounds(
            f"{where} compiles to a grammar of {len(grammar)} bytes; the local engine takes at most {MAX_GRAMMAR_BYTES}"
        )
    try:
        deep = nesting(grammar)
    except SchemaOutOfBounds as exc:
        raise SchemaOutOfBounds(f"{where}: {exc}") from None
    if deep > MAX_NESTING:
        raise SchemaOutOfBounds(
            f"{where} compiles to a grammar nested {deep} deep (the span between a minimum and a maximum length "
            f"or count); the local engine takes at most {MAX_NESTING}"
        )
    return grammar
