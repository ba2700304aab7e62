"""Tool calls' arguments as the engine gave them. An engine's arguments are a string that should
be a JSON object; a weak model, or an engine without a grammar for them, may emit something else.
Such a call is passed on as it came, never refused (a 500 would lose the answer): chat completions
and the Responses API carry the string intact (``arguments``), Anthropic's Messages, whose
``input`` is an object, carries it as ``{"_raw": "<the string>"}``. Each such call is flagged by
one ``tool_arguments_invalid`` log event (the tool's name and the string's length, never its text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import structlog

from backends.base import Body

log = structlog.get_logger("triage.tools")
RAW = "_raw"  # the key Anthropic's ``input`` holds arguments under when they are no JSON object


def parse(arguments: str) -> dict[str, Any] | None:
    """The arguments as an object ("" is none: ``{}``); None when they are no JSON object."""
    if not arguments:
        return {}
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def as_input(arguments: str) -> dict[str, Any]:
    """Anthropic's ``input`` for these arguments: the object, or the string kept under ``_raw``."""
    value = parse(arguments)
    return {RAW: arguments} if value is None else value


@dataclass
class Calls:
    """The tool calls of one answer, by (choice, call index): whole, or fed chunk by chunk."""

    names: dict[tuple[int, int], str] = field(default_factory=dict)
    arguments: dict[tuple[int, int], str] = field(default_factory=dict)

    def whole(self, completion: Body) -> Calls:
        for choice in completion.get("choices") or []:
            for i, call in enumerate((choice.get("message") or {}).get("tool_calls") or []):
                self._add((choice.get("index", 0), i), call, replace=True)
        return self

    def feed(self, chunk: Body) -> None:
        for choice in chunk.get("choices") or []:
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                self._add((choice.get("index", 0), call.get("index", 0)), call, replace=False)

    def _add(self, key: tuple[int, int], call: Any, *, replace: bool) -> None:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return
        if isinstance(fn.get("name"), str) and fn["name"]:
            self.names.setdefault(key, fn["name"])  # some engines repeat the name in every delta
        given = fn.get("arguments")
        piece = given if isinstance(given, str) else ""
        self.arguments[key] = piece if replace else self.arguments.get(key, "") + piece

    def invalid(self) -> list[tuple[str, str]]:
        """(name, arguments) of each call whose arguments are no JSON object."""
        return [(self.names.get(k, ""), a) for k, a in self.arguments.items() if parse(a) is None]

    def flag(self, request_id: str, model: str, backend: str) -> int:
        """One ``tool_arguments_invalid`` event per such call; how many there were."""
        bad = self.invalid()
        for name, arguments in bad:
            log.warning(
                "tool_arguments_invalid",
                request_id=request_id,
                model=model,
                backend=backend,
                tool=name,
                arguments_bytes=len(arguments.encode()),
            )
        return len(bad)
