"""The OpenAI request bodies triage checks before routing.

Known fields are validated; unknown fields are kept and passed through to the engine
(``extra="allow"``), so vendor extensions such as ``chat_template_kwargs`` reach it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from policies.errors import InvalidRequest, MalformedJSON

M = TypeVar("M", bound=BaseModel)

# JSON nesting a body may have. orjson parses 1,024 levels but serialises at most 254, and every
# body is serialised again (to the engine, to the batch store, to the log): refuse it up front.
MAX_DEPTH = 128


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool = False


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, part in enumerate(v):
                if not isinstance(part.get("type"), str):
                    raise ValueError(f"content part {i} has no type")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i} is a text part whose text is not a string")
        return v


class _Common(_Open):
    model: str = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: (
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]] | None
    ) = Field(None, description="token id -> bias, -100 to 100 (OpenAI's shape)")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:  # asks for nothing: OpenAI refuses it (an empty string is a prompt)
            raise ValueError("the prompt list is empty")
        return v


class BatchCreate(BaseModel):
    """``POST /v1/batches``: OpenAI's fields (extra ones, such as ``output_expires_after``, are kept)."""

    model_config = ConfigDict(extra="allow")
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/decide"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's bounds (16 pairs, keys up to 64 characters, values up to 512), and no NUL
        character, which no store of text keeps."""
        if v is None:
            return v
        if len(v) > 16:
            raise ValueError("at most 16 key-value pairs")
        for key, value in v.items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("keys may have at most 64 characters, values 512")
            if "\x00" in key or "\x00" in value:
                raise ValueError("keys and values may not hold a NUL character")
        return v


def parse_any_json(raw: bytes) -> Any:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedJSON(f"We could not parse the JSON body of your request: {exc}") from None
    check_depth(raw, value)
    return value


def check_depth(raw: bytes, value: Any, limit: int = MAX_DEPTH) -> None:
    """A 400 naming the top-level field when ``value`` (parsed from ``raw``) nests deeper than
    ``limit`` containers. Free for most bodies: it cannot, unless ``raw`` has that many brackets."""
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return
    tops = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in tops:
        if _deeper_than(item, limit - 1):
            raise InvalidRequest(
                f"'{key}' is nested more than {limit} levels deep", param=str(key), code="nested_too_deep"
            )


def _deeper_than(value: Any, limit: int) -> bool:
    """``value`` holds more than ``limit`` levels of nested objects and arrays (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse_json(raw: bytes) -> dict[str, Any]:
    body = parse_any_json(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    return body


def from_program(body: Mapping[str, Any]) -> dict[str, Any]:
    """A body a program hands in (the Python API), read as the HTTP edge reads one: written as JSON
    and parsed again, so it holds JSON values only (400 for what JSON cannot carry: a lone
    surrogate, which no engine's pipe takes either, a set, bytes) and nests within ``MAX_DEPTH``."""
    try:
        raw = orjson.dumps(body)
    except orjson.JSONEncodeError as exc:
        raise InvalidRequest(f"The request body cannot be written as JSON: {exc}") from None
    return parse_json(raw)


def chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A translated message's content parts as chat content: text alone as one string (parts joined
    by newlines), since many engines' chat templates (llama.cpp's among them) concatenate a
    message's content as a string and fail on a list; parts with an image stay a list."""
    if parts and all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def check(model: type[M], body: Mapping[str, Any]) -> M:
    """Validate ``body``; the first problem becomes a 400 naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}{more}", param=param) from None


class FeedbackRequest(BaseModel):
    """A caller's verdict on one of its requests: right or wrong, or a score, or both."""

    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=200, description="the request's x-request-id")
    verdict: Literal["right", "wrong"] | None = None
    score: float | None = Field(
        None, ge=0, le=1, allow_inf_nan=False, strict=True, description="how good the answer was, 0 to 1"
    )

    @model_validator(mode="after")
    def _something(self) -> FeedbackRequest:
        if self.verdict is None and self.score is None:
            raise ValueError("give a verdict (right or wrong), a score, or both")
        return self
