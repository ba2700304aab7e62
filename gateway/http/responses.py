"""The Responses API (``/v1/responses``) on the chat pipeline: a request is translated to a chat
body, served by :meth:`gateway.service.service.Service.generate` (routing, the cascade, keys, limits, logs, metrics as
for chat), and the chat answer translated back: a ``response`` object, or the Responses event
stream (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``, and
``error`` when the engine fails after the stream began).

What is translated: ``input`` (a string, or message items with ``input_text`` / ``output_text`` /
``input_image`` parts, ``function_call`` and ``function_call_output`` items), ``instructions``
(a system message first), ``max_output_tokens``, ``temperature``, ``top_p``, function ``tools``
and ``tool_choice``, ``text.format`` (``json_schema``, ``json_object``: to a cascade model a
one-property enum/boolean/bounded-number schema is a typed decision), ``reasoning.effort``
(``reasoning_effort``, which the reasoning adapter maps per engine family), ``stream``, ``user``,
``metadata``. Other tool types (web search, file search, computer use ...), ``background`` and
``conversation`` are refused with a 400 naming the field. A function call's ``arguments`` are the
engine's string as it gave it, JSON or not (one that is not is flagged:
:mod:`gateway.http.tool_arguments`).

Stored responses (``store``, the default, as OpenAI's) are kept in this process for an hour (the
10,000 newest at most: :class:`gateway.state.responses.ResponseStore`) and answer ``GET`` /
``DELETE /v1/responses/{id}`` and ``previous_response_id`` (the earlier turns and their output are
put before the new input). One process only: a fleet's shared store belongs with the state stores (docs/surfaces.md).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from gateway.service.bodies import chat_content
from policies.errors import InvalidRequest, TriageError

Body = dict[str, Any]
_PASSED = ("temperature", "top_p", "user", "metadata", "parallel_tool_calls", "top_logprobs")
_REFUSED = ("background", "conversation", "prompt")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields this gateway reads (others are kept and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: StrictBool | None = None
    background: StrictBool | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _bad(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _content(parts: Any, where: str) -> str | list[Body]:
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise _bad(f"'{where}' must be a string or a list of content parts", where)
    out: list[Body] = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(text, str):
            out.append({"type": "text", "text": text})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise _bad(
                f"content part {i} ({kind!r}) is not supported here (input_text, output_text, input_image)", where
            )
    return chat_content(out)


def _messages(items: Any) -> list[Body]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a string or a non-empty list of items", "input")
    out: list[Body] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _bad(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"'{where}.role' must be user, assistant, system or developer", f"{where}.role")
            out.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(f"'{where}': a function_call needs call_id, name and arguments", where)
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise _bad(f"'{where}': a function_call_output needs call_id and output (a string)", where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            raise _bad(f"'{where}': items of type {kind!r} are not supported here", f"{where}.type")
    return out


def _tools(tools: Any) -> list[Body]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"tools.{i}: only function tools are passed to the engines, not {kind!r}", f"tools.{i}")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("'tool_choice' must be auto, none, required or {type: function, name}", "tool_choice")


def _format(text: Any) -> Body | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": {"name": "answer", **schema}}
    raise _bad("'text.format' must be text, json_object or json_schema with a schema object", "text.format")


def chat_body(req: Body, earlier: list[Body]) -> tuple[Body, list[Body]]:
    """The chat body a Responses request becomes, and the turns it sends (for the store). ``req``
    has been checked against :class:`ResponsesRequest` (the route does it first)."""
    for key in _REFUSED:
        if req.get(key):
            raise _bad(f"'{key}' is not supported by this gateway", key)
    new = _messages(req["input"])
    turns = [*earlier, *new]
    messages = list(turns)
    if req.get("instructions") is not None:
        if not isinstance(req["instructions"], str):
            raise _bad("'instructions' must be a string", "instructions")
        messages = [{"role": "system", "content": req["instructions"]}, *messages]  # not carried to the next turn
    body: Body = {"model": req["model"], "messages": messages, "stream": req.get("stream", False)}
    for key in _PASSED:
        if req.get(key) is not None:
            body[key] = req[key]
    if req.get("max_output_tokens") is not None:
        body["max_tokens"] = req["max_output_tokens"]
    if req.get("tools"):
        body["tools"] = _tools(req["tools"])
    if req.get("tool_choice") is not None:
        body["tool_choice"] = _tool_choice(req["tool_choice"])
    if (fmt := _format(req.get("text"))) is not None:
        body["response_format"] = fmt
    reasoning = req.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        body["reasoning_effort"] = reasoning["effort"]
    if body["stream"] is True:
        body["stream_options"] = {"include_usage": True}
    return body, turns


def _usage(usage: Any) -> Body | None:
    if not isinstance(usage, dict):
        return None
    inp, out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": int(cached)},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": inp + out,
    }


def _message_item(text: str, item_id: str, status: str = "completed") -> Body:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _call_item(call: Body, status: str = "completed") -> Body:
    fn = call.get("function") or {}
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call.get("id") or new_id("call"),
        "name": fn.get("name", ""),
        "arguments": fn.get("arguments", ""),
        "status": status,
    }


def shell(req: Body, response_id: str, model: str, status: str = "in_progress") -> Body:
    """A response object without output yet (what ``response.created`` carries)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "metadata": req.get("metadata") or {},
        "parallel_tool_calls": req.get("parallel_tool_calls", True),
        "previous_response_id": req.get("previous_response_id"),
        "reasoning": req.get("reasoning"),
        "store": req.get("store", True),
        "temperature": req.get("temperature"),
        "text": req.get("text") or {"format": {"type": "text"}},
        "tool_choice": req.get("tool_choice", "auto"),
        "tools": req.get("tools") or [],
        "top_p": req.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": req.get("user"),
    }


def from_chat(req: Body, response_id: str, completion: Body) -> tuple[Body, Body]:
    """The response object for a chat completion, and the assistant turn it adds (for the store)."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    requested: str = req.get("model", "")
    out = shell(req, response_id, completion.get("model", requested), "completed")
    items: list[Body] = []
    if message.get("content"):
        items.append(_message_item(message["content"], new_id("msg")))
    items += [_call_item(c) for c in message.get("tool_calls") or []]
    out["output"] = items
    out["usage"] = _usage(completion.get("usage"))
    if choice.get("finish_reason") == "length":
        out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    if "triage" in completion:  # a typed decision: the decision and its trace
        out["triage"] = completion["triage"]
    turn: Body = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return out, turn


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    return (
        b"event: "
        + kind.encode()
        + b"\ndata: "
        + orjson.dumps({"type": kind, "sequence_number": seq, **fields})
        + b"\n\n"
    )


@dataclass
class _Text:
    item_id: str
    index: int
    text: str = ""


@dataclass
class _Call:
    index: int
    call_id: str
    name: str
    item_id: str = field(default_factory=lambda: new_id("fc"))
    arguments: str = ""


class StreamTranslator:
    """Chat completion chunks in, Responses events out (``feed`` per chunk, then ``finish``)."""

    def __init__(
        self, req: Body, response_id: str, model: str, on_done: Callable[[Body, Body], None] | None = None
    ) -> None:
        self.req, self.response = req, shell(req, response_id, model)
        self.on_done = on_done  # the completed response and its assistant turn (the store)
        self.seq = 0
        self.text: _Text | None = None
        self.calls: dict[int, _Call] = {}
        self.items: list[Body] = []
        self.usage: Any = None
        self.finish_reason: str | None = None

    def _next(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return _event(kind, self.seq - 1, **fields)

    def start(self) -> bytes:
        return self._next("response.created", response=self.response) + self._next(
            "response.in_progress", response=self.response
        )

    def feed(self, chunk: Body) -> bytes:
        out = b""
        if chunk.get("model"):
            self.response["model"] = chunk["model"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _text_delta(self, delta: str) -> bytes:
        out = b""
        if self.text is None:
            self.text = _Text(new_id("msg"), len(self.items) + len(self.calls))
            item = _message_item("", self.text.item_id, "in_progress")
            item["content"] = []
            out += self._next("response.output_item.added", output_index=self.text.index, item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._next(
                "response.content_part.added",
                item_id=self.text.item_id,
                output_index=self.text.index,
                content_index=0,
                part=part,
            )
        self.text.text += delta
        return out + self._next(
            "response.output_text.delta",
            item_id=self.text.item_id,
            output_index=self.text.index,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def _call_delta(self, call: Body) -> bytes:
        index = call.get("index", 0)
        fn = call.get("function") or {}
        out = b""
        if index not in self.calls:
            position = (1 if self.text is not None else 0) + len(self.calls)
            self.calls[index] = _Call(position, call.get("id") or new_id("call"), fn.get("name") or "")
            c = self.calls[index]
            item = {
                "id": c.item_id,
                "type": "function_call",
                "call_id": c.call_id,
                "name": c.name,
                "arguments": "",
                "status": "in_progress",
            }
            out += self._next("response.output_item.added", output_index=c.index, item=item)
        c = self.calls[index]
        if fn.get("arguments"):
            c.arguments += fn["arguments"]
            out += self._next(
                "response.function_call_arguments.delta", item_id=c.item_id, output_index=c.index, delta=fn["arguments"]
            )
        return out

    def finish(self) -> tuple[bytes, Body, Body]:
        """The closing events, the completed response, and the assistant turn (for the store)."""
        out, items = b"", []
        turn: Body = {"role": "assistant", "content": self.text.text if self.text is not None else None}
        if self.text is not None:
            t = self.text
            part = {"type": "output_text", "text": t.text, "annotations": [], "logprobs": []}
            out += self._next(
                "response.output_text.done",
                item_id=t.item_id,
                output_index=t.index,
                content_index=0,
                text=t.text,
                logprobs=[],
            )
            out += self._next(
                "response.content_part.done", item_id=t.item_id, output_index=t.index, content_index=0, part=part
            )
            item = _message_item(t.text, t.item_id)
            out += self._next("response.output_item.done", output_index=t.index, item=item)
            items.append(item)
        calls = []
        for c in self.calls.values():
            out += self._next(
                "response.function_call_arguments.done", item_id=c.item_id, output_index=c.index, arguments=c.arguments
            )
            item = {
                "id": c.item_id,
                "type": "function_call",
                "call_id": c.call_id,
                "name": c.name,
                "arguments": c.arguments,
                "status": "completed",
            }
            out += self._next("response.output_item.done", output_index=c.index, item=item)
            items.append(item)
            calls.append({"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
        if calls:
            turn["tool_calls"] = calls
        self.response.update(status="completed", output=items, usage=_usage(self.usage))
        if self.finish_reason == "length":
            self.response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return out + self._next(kind, response=self.response), self.response, turn

    def end(self) -> bytes:
        events, out, turn = self.finish()
        if self.on_done is not None:
            self.on_done(out, turn)
        return events

    def fail(self, exc: TriageError) -> bytes:
        """A failure after the stream began: the ``error`` event, then ``response.failed``."""
        code, message = exc.code, exc.message
        self.response.update(status="failed", error={"code": code, "message": message})
        return self._next("error", code=code, message=message, param=None) + self._next(
            "response.failed", response=self.response
        )
