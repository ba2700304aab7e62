"""The JSON schemas a local llama.cpp engine survives, checked before one reaches it.

Every schema that reaches a local engine passes :func:`check` first (``backends.llamacpp``: a
``response_format`` on any surface, each tool's ``parameters``, the Batch API's lines, all as chat
bodies by then). llama-cpp-python turns the schema into a GBNF grammar (its converter, pure
Python) and llama.cpp parses and samples it natively, where a fault ends the worker process with
every request in it. The check refuses, with a 400 naming the field:

- what the converter cannot visit: a ``pattern`` with an unmatched ``]`` or ``}`` (it loops for
  ever on one), a boolean sub-schema (``{"items": true}``, ``{"anyOf":
  [false]}``; only ``additionalProperties`` may be one), a non-local ``$ref`` or one that names no
  schema, a keyword of the wrong shape;
- empty alternatives (``{"enum": []}``, ``{"anyOf": []}``, ``{"type": []}``): the converter writes an
  empty rule, which llama.cpp does not parse (SIGSEGV);
- text the converter cannot write in a grammar the engine survives, in an ``enum``, ``const`` or
  property name (a ``pattern`` is read in its grammar, below): NUL and lone UTF-16 surrogates (no
  token holds them: llama.cpp's sampler finds no token and throws, SIGABRT), a quote, backspace
  or form feed (escapes llama.cpp does not parse: SIGSEGV);
- sizes: a length or count past ``MAX_COUNT`` (an optional run of ``maxLength`` minus
  ``minLength`` characters becomes that many nested groups, and past about a thousand the parser
  overflows its stack: measured on SmolLM2, llama-cpp-python 0.3.36, AMD EPYC with AVX-512 VNNI,
  2026-12-03, ``maxLength`` 1,000 serves and 2,000 kills the process), an ``enum`` or union past
  ``MAX_ALTERNATIVES`` (each alternative is a grammar stack the sampler walks for every token:
  10,000 values held the engine past its deadline);
- then the grammar it compiles to, read as llama.cpp reads it (``backends.gbnf``): what does not
  parse, left recursion, nesting past ``MAX_NESTING``, a grammar past ``MAX_GRAMMAR_BYTES``.

``tests/backends/test_schema_fuzz.py`` runs generated schemas the check accepts through the real engine.
"""

from __future__ import annotations

import json
from typing import Any

from backends import gbnf

MAX_COUNT = 4096  # any length or count keyword of the schema
MAX_NESTING = 512  # groups inside groups in the compiled grammar
MAX_ALTERNATIVES = 1024  # values of one enum, schemas of one anyOf / oneOf, alternatives of one rule
MAX_GRAMMAR_BYTES = 256 * 1024
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_TYPES = frozenset(("string", "number", "integer", "boolean", "null", "object", "array"))
_UNIONS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_TEXTS = ("pattern", "format", "$ref")


class SchemaOutOfBounds(ValueError):
    """A schema the local engine cannot take; ``where`` is the field at fault."""

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.where = where


# What the converter cannot write into a grammar literal: NUL and lone surrogates (it writes them,
# and no token's text holds them: SIGABRT), a quote, backspace and form feed (it writes escapes
# llama.cpp does not parse: SIGSEGV).
_UNWRITABLE = frozenset('\x00"\b\f')


def _dead_text(value: Any) -> str | None:
    """The first character in a JSON value's strings (keys too) that the converter cannot write
    into a grammar the engine survives, as U+XXXX."""
    if isinstance(value, str):
        for ch in value:
            if ch in _UNWRITABLE or "\ud800" <= ch <= "\udfff":
                return f"U+{ord(ch):04X}"
    elif isinstance(value, list):
        for item in value:
            if found := _dead_text(item):
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            if found := _dead_text(key) or _dead_text(item):
                return found
    return None


def _pattern_stuck_at(pattern: str) -> int | None:
    """Where llama-cpp-python 0.3.36's pattern converter would loop for ever (a ``]`` or ``}``
    outside a character class or a count: its scan neither takes nor skips one), scanning as it
    scans; None where it goes through. SchemaOutOfBounds for a count it would write out past
    MAX_COUNT times (``x{0,100000000}`` is a string of gigabytes before any grammar is read)."""
    if not (pattern.startswith("^") and pattern.endswith("$")):
        return None  # refused by the converter itself
    body, i = pattern[1:-1], 0
    while i < len(body):
        c = body[i]
        if c == "[":
            i += 1
            while i < len(body) and body[i] != "]":
                i += 2 if body[i] == "\\" else 1
            i += 1
        elif c == "{":
            start = i
            while i < len(body) and body[i] != "}":
                i += 1
            counts = [n.strip() for n in body[start + 1 : i].split(",")]
            if any(n.isdigit() and int(n) > MAX_COUNT for n in counts):  # it writes them out, repeated
                raise SchemaOutOfBounds(f"the count {body[start : i + 1]}")
            i += 1
        elif c in "]}":
            return i + 1
        else:
            i += 2 if c == "\\" else 1
    return None


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return any("\ud800" <= ch <= "\udfff" for ch in value)
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    return False


class _Walk:
    """Every sub-schema the converter may visit, each checked once (``$ref`` targets included)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.seen: set[int] = set()

    def schema(self, node: Any, where: str) -> None:
        if isinstance(node, bool):
            raise SchemaOutOfBounds(
                f"{where} is the boolean schema {str(node).lower()}; the local engine takes only object schemas here",
                where,
            )
        if not isinstance(node, dict):
            raise SchemaOutOfBounds(f"{where} must be a JSON schema object", where)
        if id(node) in self.seen:
            return
        self.seen.add(id(node))
        for key in _COUNTS:
            self.count(node, key, where)
        for key in _TEXTS:
            if key in node and not isinstance(node[key], str):
                raise SchemaOutOfBounds(f"{where}.{key} must be a string", f"{where}.{key}")
        self.type(node.get("type"), f"{where}.type")
        self.values(node, where)
        self.subschemas(node, where)
        if "$ref" in node:
            self.ref(node["$ref"], f"{where}.$ref")

    def count(self, node: dict[str, Any], key: str, where: str) -> None:
        value = node.get(key)
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SchemaOutOfBounds(f"{where}.{key} must be a non-negative integer", f"{where}.{key}")
        if value > MAX_COUNT:
            raise SchemaOutOfBounds(
                f"{where}.{key} is {value}; the local engine takes at most {MAX_COUNT}", f"{where}.{key}"
            )

    def type(self, value: Any, where: str) -> None:
        if value is None:
            return
        types = value if isinstance(value, list) else [value]
        if not types:
            raise SchemaOutOfBounds(f"{where} is an empty list: no value can match it", where)
        for t in types:
            if t not in _TYPES:
                raise SchemaOutOfBounds(f"{where}: {t!r} is not a JSON schema type", where)

    def values(self, node: dict[str, Any], where: str) -> None:
        if "enum" in node:
            enum, at = node["enum"], f"{where}.enum"
            if not isinstance(enum, list) or not enum:
                raise SchemaOutOfBounds(f"{at} must be a non-empty list: no value can match an empty one", at)
            self.bounded(enum, at)
            if found := _dead_text(enum):
                raise SchemaOutOfBounds(f"{at} holds the character {found}, which the local engine cannot write", at)
        if "const" in node and (found := _dead_text(node["const"])):
            at = f"{where}.const"
            raise SchemaOutOfBounds(f"{at} holds the character {found}, which the local engine cannot write", at)
        pattern = node.get("pattern")
        at = f"{where}.pattern"
        try:
            at_char = _pattern_stuck_at(pattern) if isinstance(pattern, str) else None
        except SchemaOutOfBounds as exc:
            raise SchemaOutOfBounds(f"{at} has {exc}; the local engine takes at most {MAX_COUNT}", at) from None
        if isinstance(pattern, str) and at_char is not None:
            raise SchemaOutOfBounds(
                f"{at} has an unmatched {pattern[at_char]!r} at character {at_char}, which the local engine's "
                "grammar converter cannot read (escape it)",
                at,
            )
        required = node.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise SchemaOutOfBounds(f"{where}.required must be a list of property names", f"{where}.required")

    def bounded(self, items: list[Any], where: str) -> None:
        if len(items) > MAX_ALTERNATIVES:
            raise SchemaOutOfBounds(
                f"{where} has {len(items)} alternatives; the local engine takes at most {MAX_ALTERNATIVES}", where
            )

    def subschemas(self, node: dict[str, Any], where: str) -> None:
        for key in _UNIONS:
            if key in node:
                items, at = node[key], f"{where}.{key}"
                if not isinstance(items, list) or (not items and key != "allOf"):
                    raise SchemaOutOfBounds(f"{at} must be a non-empty list of schemas", at)
                self.bounded(items, at)
                for i, item in enumerate(items):
                    self.schema(item, f"{at}[{i}]")
        for key in _SCHEMA_MAPS:
            if key in node:
                table, at = node[key], f"{where}.{key}"
                if not isinstance(table, dict):
                    raise SchemaOutOfBounds(f"{at} must be an object of schemas", at)
                for name, item in table.items():
                    if key == "properties" and (found := _dead_text(name)):
                        raise SchemaOutOfBounds(f"{at} has a name holding {found}, which the engine cannot write", at)
                    self.schema(item, f"{at}.{name}")
        if "items" in node:
            items, at = node["items"], f"{where}.items"
            for k, item in enumerate(items) if isinstance(items, list) else [(-1, items)]:
                self.schema(item, at if k < 0 else f"{at}[{k}]")
        extra = node.get("additionalProperties")
        if extra is not None and not isinstance(extra, bool):
            self.schema(extra, f"{where}.additionalProperties")

    def ref(self, ref: str, where: str) -> None:
        if not ref.startswith("#/"):
            raise SchemaOutOfBounds(f"{where}: the local engine takes only local references (#/...)", where)
        target: Any = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                raise SchemaOutOfBounds(f"{where}: {ref} names nothing in the schema", where)
            target = target[part]
        self.schema(target, where)


def nesting(grammar: str) -> int:
    """The deepest nesting of groups in a GBNF grammar; SchemaOutOfBounds for what llama.cpp does
    not take (``backends.gbnf``)."""
    try:
        return gbnf.read(grammar, MAX_NESTING).depth
    except gbnf.GrammarRefused as exc:
        raise SchemaOutOfBounds(f"the local engine cannot read the grammar: {exc}") from None


def check_grammar(grammar: str, where: str) -> gbnf.Grammar:
    """A grammar the engine survives, read; SchemaOutOfBounds naming ``where`` otherwise."""
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise SchemaOutOfBounds(
            f"{where} compiles to a grammar of {len(grammar)} bytes; the local engine takes at most "
            f"{MAX_GRAMMAR_BYTES}",
            where,
        )
    try:
        read = gbnf.read(grammar, MAX_NESTING)
    except gbnf.TooDeep:
        raise SchemaOutOfBounds(
            f"{where} compiles to a grammar nested more than {MAX_NESTING} deep (the span between a minimum and "
            f"a maximum length or count, or schemas inside schemas); the local engine takes at most {MAX_NESTING}",
            where,
        ) from None
    except gbnf.GrammarRefused as exc:
        raise SchemaOutOfBounds(f"{where}: the local engine cannot take its grammar: {exc}", where) from None
    if read.stacks > MAX_ALTERNATIVES:
        raise SchemaOutOfBounds(
            f"{where} compiles to a grammar with {read.stacks} alternatives open at once; the local engine takes "
            f"at most {MAX_ALTERNATIVES}",
            where,
        )
    return read


def check(schema: Any, where: str = "schema") -> str:
    """The grammar the schema compiles to, or SchemaOutOfBounds naming the field at fault."""
    if _has_surrogate(schema):  # not UTF-8: it cannot even cross the pipe to the engine's worker
        raise SchemaOutOfBounds(f"{where} holds a lone UTF-16 surrogate, which the local engine cannot take", where)
    _Walk(schema).schema(schema, where)
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        grammar = json_schema_to_gbnf(json.dumps(schema))
    except (ValueError, TypeError, KeyError, AttributeError, AssertionError, RecursionError, IndexError) as exc:
        raise SchemaOutOfBounds(f"{where}: the local engine cannot turn it into a grammar: {exc}", where) from None
    check_grammar(grammar, where)
    return grammar
