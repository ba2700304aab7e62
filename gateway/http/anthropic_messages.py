"""Anthropic's Messages API (``/v1/messages``) on the chat pipeline: a request is translated to a
chat body and served by :meth:`gateway.service.service.Service.generate` (routing, keys, limits, logs, metrics as for
chat); the chat answer comes back as a ``message``, or as Anthropic's event stream
(``message_start``, ``content_block_start``, ``content_block_delta``, ``content_block_stop``,
``message_delta``, ``message_stop``; ``error`` when the engine fails after the stream began).
Errors are in Anthropic's shape, ``{"type": "error", "error": {"type": ..., "message": ...}}``.

Translated: ``system`` (a string or text blocks), ``messages`` with text, image (base64 or URL),
``tool_use`` and ``tool_result`` blocks, ``max_tokens``, ``stop_sequences``, ``temperature``,
``top_p``, ``tools`` (``input_schema`` as the function's parameters) and ``tool_choice`` (auto,
any, tool, none), ``thinking`` (enabled or disabled: the chat ``reasoning_effort``, which the
reasoning adapter maps per engine family), ``output_config`` (``effort`` the same way; ``format``,
a JSON schema, as ``response_format``: to a cascade model a one-property enum/boolean/bounded-number
schema is a typed decision, and the answer carries it in ``triage``), ``metadata.user_id``
(``user``). ``top_k`` is passed as the vendor field it is for the engines that take it (vLLM,
SGLang, llama.cpp); the current SDK no longer sends ``temperature``, ``top_p`` or ``top_k``, older
ones do.

A tool call's ``input`` is the engine's arguments parsed; arguments that are no JSON object are
kept as ``{"_raw": "<the string>"}`` and flagged (:mod:`gateway.http.tool_arguments`). Streamed,
a call's arguments go out in one ``input_json_delta`` when the call is complete, so that what a
client parses is always JSON (the SDK's stream accumulator raises on a delta that is not).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from gateway.http.tool_arguments import as_input, parse
from gateway.service.bodies import chat_content, check
from policies.errors import InvalidRequest, TriageError

Body = dict[str, Any]
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "overloaded_error",
}


class MessagesRequest(BaseModel):
    """``POST /v1/messages``: the fields this gateway reads (others are kept and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def error_body(exc: TriageError) -> Body:
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def _bad(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param)


def _text_of(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in blocks
    ):
        return "\n".join(b["text"] for b in blocks)
    raise _bad("must be a string or a list of text blocks", where)


def _image(block: Body, where: str) -> Body:
    given = block.get("source")
    source: Body = given if isinstance(given, dict) else {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _bad("an image block needs a base64 or url source", where)
    return {"type": "image_url", "image_url": {"url": url}}


def _turn(message: Body, where: str) -> list[Body]:
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise _bad("role must be user or assistant", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of blocks", f"{where}.content")
    parts: list[Body] = []
    calls: list[Body] = []
    results: list[Body] = []
    for i, block in enumerate(content):
        at = f"{where}.content.{i}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {"id": block.get("id"), "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
            inner = block.get("content", "")
            text = inner if isinstance(inner, str) else _text_of(inner, f"{at}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind == "thinking" and role == "assistant":
            continue  # an earlier turn's thinking: the engines take no such input
        else:
            raise _bad(f"a {kind!r} block is not supported here", f"{at}.type")
    out: list[Body] = [*results]
    if parts or calls:
        turn: Body = {"role": role, "content": chat_content(parts) if parts else None}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _tools(tools: list[Body]) -> list[Body]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
            raise _bad("only custom tools (name, description, input_schema) are passed to the engines", f"tools.{i}")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if isinstance(tool.get("strict"), bool):  # arguments to the schema exactly (vLLM: under a grammar)
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Body) -> Any:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("must be auto, any, none or {type: tool, name}", "tool_choice")


def _output_config(config: Body, body: Body) -> None:
    """``effort`` as the chat ``reasoning_effort``; ``format`` (a JSON schema) as ``response_format``,
    so that a one-property enum/boolean/bounded-number schema to a cascade model is a typed decision."""
    effort = config.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "xhigh", "max"):
            raise _bad("must be low, medium, high, xhigh or max", "output_config.effort")
        body["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(effort, effort)
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad("must be {type: json_schema, schema: {...}}", "output_config.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": fmt["schema"]}}


def chat_body(req: Body) -> Body:
    """The chat body a Messages request becomes."""
    checked = check(MessagesRequest, req)
    messages: list[Body] = []
    if checked.system is not None:
        messages.append({"role": "system", "content": _text_of(checked.system, "system")})
    for i, m in enumerate(checked.messages):
        messages += _turn(m, f"messages.{i}")
    body: Body = {
        "model": checked.model,
        "messages": messages,
        "max_tokens": checked.max_tokens,
        "stream": checked.stream,
    }
    for key in ("temperature", "top_p", "top_k"):
        if (value := getattr(checked, key)) is not None:
            body[key] = value
    if checked.stop_sequences:
        body["stop"] = checked.stop_sequences
    if checked.tools:
        body["tools"] = _tools(checked.tools)
    if checked.tool_choice is not None:
        body["tool_choice"] = _tool_choice(checked.tool_choice)
    if checked.thinking is not None:
        kind = checked.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise _bad("type must be enabled, disabled or adaptive", "thinking.type")
        body["reasoning_effort"] = "minimal" if kind == "disabled" else "medium"
    if checked.output_config is not None:
        _output_config(checked.output_config, body)
    if isinstance((checked.metadata or {}).get("user_id"), str):
        body["user"] = checked.metadata["user_id"]  # type: ignore[index]
    if checked.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _usage(usage: Any) -> Body:
    u = usage if isinstance(usage, dict) else {}
    return {"input_tokens": int(u.get("prompt_tokens") or 0), "output_tokens": int(u.get("completion_tokens") or 0)}


def new_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def from_chat(completion: Body) -> Body:
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[Body] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{secrets.token_hex(8)}",
                "name": fn.get("name", ""),
                "input": as_input(fn.get("arguments") or ""),
            }
        )
    reason = _stop_reason(choice.get("finish_reason"), bool(message.get("tool_calls")))
    extension = {"triage": completion["triage"]} if "triage" in completion else {}  # a typed decision's
    return {
        **extension,
        "id": new_id(),
        "type": "message",
        "role": "assistant",
        "model": completion.get("model", ""),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": None,
        "usage": _usage(completion.get("usage")),
    }


def _stop_reason(finish_reason: str | None, called: bool) -> str:
    """Anthropic's ``stop_reason``: ``tool_use`` whenever the answer calls a tool (an engine under a
    named ``tool_choice``, vLLM and OpenAI both, says ``stop`` then)."""
    reason = _STOP.get(finish_reason or "stop", "end_turn")
    return "tool_use" if called and reason == "end_turn" else reason


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


@dataclass
class StreamTranslator:
    """Chat completion chunks in, Anthropic's events out."""

    model: str
    message_id: str = field(default_factory=new_id)
    block: int = -1  # the open content block's index
    open_kind: str | None = None  # "text" or a tool call's index as a string
    arguments: str = ""  # the open tool call's arguments so far (sent whole when it closes)
    called: bool = False  # a tool_use block was sent
    usage: Any = None
    finish_reason: str | None = None

    def start(self) -> bytes:
        message: Body = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _event("message_start", message=message) + _event("ping")

    def _open(self, kind: str, block: Body) -> bytes:
        out = self._close()
        self.block += 1
        self.open_kind = kind
        return out + _event("content_block_start", index=self.block, content_block=block)

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        out = b""
        if self.open_kind != "text" and self.arguments:
            raw = self.arguments
            whole = raw if parse(raw) is not None else orjson.dumps(as_input(raw)).decode()
            out = _event(
                "content_block_delta", index=self.block, delta={"type": "input_json_delta", "partial_json": whole}
            )
        self.open_kind, self.arguments = None, ""
        return out + _event("content_block_stop", index=self.block)

    def feed(self, chunk: Body) -> bytes:
        out = b""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open_kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out += _event(
                    "content_block_delta", index=self.block, delta={"type": "text_delta", "text": delta["content"]}
                )
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                key = f"tool{call.get('index', 0)}"
                if self.open_kind != key:
                    block = {
                        "type": "tool_use",
                        "id": call.get("id") or f"toolu_{secrets.token_hex(8)}",
                        "name": fn.get("name", ""),
                        "input": {},
                    }
                    out += self._open(key, block)
                    self.called = True
                if isinstance(fn.get("arguments"), str):
                    self.arguments += fn["arguments"]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def finish(self) -> bytes:
        reason = _stop_reason(self.finish_reason, self.called)
        usage = _usage(self.usage)
        # cumulative, as Anthropic's: the input's count too, known only now (message_start said 0)
        counts = usage if self.usage else {"output_tokens": usage["output_tokens"]}
        return (
            self._close()
            + _event("message_delta", delta={"stop_reason": reason, "stop_sequence": None}, usage=counts)
            + _event("message_stop")
        )

    def end(self) -> bytes:
        return self.finish()

    def fail(self, exc: TriageError) -> bytes:
        return _event("error", error=error_body(exc)["error"])
