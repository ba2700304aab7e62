"""What a request needs of a model, and whether a model takes it. Pure: no I/O.

A model's :class:`Fit` (its context, whether it takes tools and images) is the policy's declared
value or what its engine says, settled at start-up (``gateway.service.runtime``). A request's
:class:`Shape` is read once from its body: the text it sends, its messages, the completion tokens it
asks room for, whether it carries tools or images.

Whether a prompt fits is decided without a tokenizer when it surely does: no tokenizer of these
models (byte-level BPE, SentencePiece with byte fallback, WordPiece) makes more tokens than the
text has UTF-8 bytes, plus the chat template's few tokens a message (:data:`PER_MESSAGE`). Only a
prompt that may not fit is counted: by the model's own tokenizer where one is known, else estimated
(:func:`estimate`, said as such wherever it decides).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from policies.errors import NothingFits

PER_MESSAGE = 8  # tokens a chat template adds around one message (ChatML and Llama 3: 5 or 6)
BYTES_PER_TOKEN = 3  # the estimate without a tokenizer: more tokens than English text has (about 4 bytes each)
_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


@dataclass(frozen=True)
class Fit:
    """What a model takes."""

    context: int | None  # tokens, prompt and completion together; None: not known, never refused for length
    tools: bool
    images: bool
    source: Literal["declared", "engine", "unknown"] = "unknown"  # where the context came from
    json_schema: bool = True


@dataclass(frozen=True)
class Shape:
    """What a request needs of whichever model serves it."""

    text: str  # every message's text, the tools' definitions: what its prompt tokens are made of
    messages: int
    completion: int  # completion tokens it asks room for (max_tokens; at least one)
    tools: bool
    images: bool
    size: int  # the text's UTF-8 bytes
    json_schema: bool = False  # it asks for an answer to a JSON schema

    @property
    def bound(self) -> int:
        """Surely no more prompt tokens than this, whatever the tokenizer."""
        return self.size + PER_MESSAGE * self.messages


def _text(content: Any, parts: list[str]) -> bool:
    """``content``'s text into ``parts``; whether it holds an image."""
    if isinstance(content, str):
        parts.append(content)
        return False
    images = False
    for part in content if isinstance(content, list) else ():
        if not isinstance(part, dict):
            continue
        if part.get("type") in _IMAGE_PARTS:
            images = True
        elif isinstance(part.get("text"), str):
            parts.append(part["text"])
    return images


def shape_of(kind: str, body: dict[str, Any]) -> Shape:
    """A chat or text completion body's :class:`Shape` (read after the body was checked)."""
    parts: list[str] = []
    images, messages = False, 1
    if kind == "chat":
        turns = body.get("messages") or []
        messages = len(turns)
        for m in turns:
            if not isinstance(m, dict):
                continue
            images |= _text(m.get("content"), parts)
            for call in m.get("tool_calls") or ():
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    parts.append(f"{fn.get('name', '')} {fn.get('arguments', '')}")
    else:
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) else [prompt]
        for p in prompts:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, list):  # token ids: each one token, as many bytes at least
                parts.append("x" * len(p))
    tools = bool(body.get("tools") or body.get("functions"))
    if tools:
        parts.append(orjson.dumps(body.get("tools") or body.get("functions")).decode())
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    completion = asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else 1
    text = "\n".join(parts)
    fmt = body.get("response_format")
    schema = isinstance(fmt, dict) and fmt.get("type") == "json_schema"
    return Shape(text, messages, completion, tools, images, len(text.encode()), schema)


def estimate(shape: Shape) -> int:
    """The prompt's tokens without a tokenizer (UTF-8 bytes / 3, and the template's)."""
    return math.ceil(shape.size / BYTES_PER_TOKEN) + PER_MESSAGE * shape.messages


def takes(fit: Fit, shape: Shape) -> str | None:
    """Why a model cannot take what the request carries (tools, images); None when it can."""
    if shape.tools and not fit.tools:
        return "it takes no tools"
    if shape.images and not fit.images:
        return "it takes no images"
    if shape.json_schema and not fit.json_schema:
        return "it answers to no JSON schema"
    return None


def surely_fits(fit: Fit, shape: Shape) -> bool:
    return fit.context is None or shape.bound + shape.completion <= fit.context


def nothing_fits(what: str, refused: Sequence[tuple[str, str]], param: str) -> NothingFits:
    """The 400 when nothing ``what`` may go to can take the request (``refused``: each one and
    why): OpenAI's ``context_length_exceeded`` where a context was too small, else
    ``unsupported_request`` (tools, images, a question no tier answers)."""
    reasons = "; ".join(f"{name}: {why}" for name, why in refused)
    length = any("context holds" in why for _, why in refused)
    return NothingFits(
        f"nothing {what} can take this request ({reasons})",
        param=param,
        code="context_length_exceeded" if length else "unsupported_request",
    )


def too_long(fit: Fit, shape: Shape, tokens: int, how: str) -> str | None:
    """Why the prompt (``tokens`` of it, counted ``how``) does not fit; None when it does."""
    if fit.context is None or tokens + shape.completion <= fit.context:
        return None
    return (
        f"its context holds {fit.context} tokens; the prompt is {tokens} ({how}) "
        f"and {shape.completion} more are asked for the completion"
    )
