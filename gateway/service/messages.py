"""Chat messages: the text of a message's content (a string, or the text parts of a content list),
and the turns as every engine takes them."""

from __future__ import annotations

from typing import Any


def text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return " ".join(
            p["text"]
            for p in content
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return ""


def for_engines(turns: list[Any]) -> list[Any]:
    """Chat turns as every engine takes them: an assistant turn's null ``content`` beside its tool
    calls sent as ``""``. OpenAI's chat takes either, but llama-cpp-python's server refuses the null
    (a 500) and its chatml-function-calling template reads the content (a 500 when it is left out);
    the Responses and Messages surfaces write the null, and clients echo it back."""
    return [
        {**t, "content": ""}
        if isinstance(t, dict) and t.get("role") == "assistant" and t.get("tool_calls") and t.get("content") is None
        else t
        for t in turns
    ]
