"""OpenAI response bodies built by the in-process backends (scripted, llamacpp)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from backends.base import Body, Kind


def new_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(kind: Kind, model: str, texts: list[str], finish: str, use: dict[str, int]) -> Body:
    if kind == "chat":
        choices: list[dict[str, Any]] = [
            {"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": finish}
            for i, t in enumerate(texts)
        ]
        obj = "chat.completion"
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": finish} for i, t in enumerate(texts)]
        obj = "text_completion"
    return {
        "id": new_id(kind),
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chunk(kind: Kind, cid: str, model: str, text: str | None, finish: str | None, first: bool = False) -> Body:
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": cid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(kind: Kind, cid: str, model: str, use: dict[str, int]) -> Body:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": cid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}
