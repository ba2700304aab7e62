"""The ``scripted`` backend: real code paths, behaviour fixed by typed policy fields.

Used by tests and demos: fixed text (or a reply chosen by what the last message contains), a tool
call (its arguments as given, JSON or not) to a request that carries tools, latency before the
first byte, the first N calls failing, a stream that dies after N chunks.
Token counts are whitespace words (it has no tokenizer).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson

from backends import shapes
from backends.base import Attempt, Body, Call, Capabilities, ChunkStream, Completion, Stopwatch
from policies.errors import InvalidRequest, UpstreamError, UpstreamTimeout


class ScriptedBackend:
    capabilities = Capabilities()

    def __init__(self, name: str, spec: Any) -> None:
        self.name = name
        self.spec = spec
        self.calls = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def healthy(self) -> bool:
        return bool(self.spec.ready)

    async def context_length(self, upstream: str) -> int | None:
        return self.spec.context_length

    def _text(self, call: Call) -> str:
        if self.spec.echo:  # what a router test needs to see: the body as this backend got it
            try:
                return orjson.dumps(call.body, option=orjson.OPT_SORT_KEYS).decode()
            except orjson.JSONEncodeError as exc:  # the edge bounds nesting; this is the backstop
                raise InvalidRequest(f"The request cannot be sent on: {exc}", code="nested_too_deep") from None
        if self.spec.replies:
            last = _last_text(call.body)
            for reply in self.spec.replies:
                if reply.contains in last:
                    return str(reply.text)
        return self.spec.text

    def _pieces(self, call: Call) -> list[str]:
        words = self._text(call).split(" ")
        n = min(self.spec.chunks, len(words))
        size = -(-len(words) // n)
        return [
            " ".join(words[i : i + size]) + (" " if i + size < len(words) else "") for i in range(0, len(words), size)
        ]

    def _usage(self, call: Call) -> dict[str, int]:
        if call.kind == "completion":
            prompt = call.body.get("prompt")
            texts = [prompt] if isinstance(prompt, str) else [p for p in prompt or () if isinstance(p, str)]
        else:
            texts = [m.get("content") for m in call.body.get("messages") or () if isinstance(m.get("content"), str)]
        return shapes.usage(sum(len(t.split()) for t in texts), len(self._text(call).split()))

    async def _begin(self, call: Call) -> Stopwatch:
        watch = Stopwatch()
        self.calls += 1
        if self.calls <= self.spec.fail_first:
            call.attempts.append(Attempt(self.name, "scripted", "error", watch.elapsed()))
            raise UpstreamError(f"scripted failure {self.calls} of {self.spec.fail_first}")
        if self.spec.latency_s > self.spec.timeouts.first_byte_s:
            await asyncio.sleep(self.spec.timeouts.first_byte_s)
            call.attempts.append(Attempt(self.name, "scripted", "timeout", watch.elapsed()))
            raise UpstreamTimeout(f"upstream {self.name} timed out")
        await asyncio.sleep(self.spec.latency_s)
        return watch

    def _tool_call(self, call: Call) -> Body | None:
        """The scripted tool call, when the request carries tools (chat only)."""
        spec = self.spec.tool_call
        if spec is None or call.kind != "chat" or not call.body.get("tools"):
            return None
        return {
            "id": f"call_{self.calls}",
            "type": "function",
            "function": {"name": spec.name, "arguments": spec.arguments},
        }

    async def complete(self, call: Call) -> Completion:
        watch = await self._begin(call)
        n = int(call.body.get("n") or 1)
        tool = self._tool_call(call)
        finish = "stop" if tool is None else "tool_calls"
        body = shapes.response(call.kind, call.body["model"], [self._text(call)] * n, finish, self._usage(call))
        if tool is not None:
            for choice in body["choices"]:
                choice["message"].update(content=None, tool_calls=[tool])
        call.attempts.append(Attempt(self.name, "scripted", "ok", watch.elapsed()))
        return Completion(body, "scripted")

    async def open_stream(self, call: Call) -> ChunkStream:
        watch = await self._begin(call)
        call.attempts.append(Attempt(self.name, "scripted", "ok", watch.elapsed()))
        chunks = self._chunks(call)
        first = await anext(chunks)
        return ChunkStream(first, chunks, "scripted")

    async def _chunks(self, call: Call) -> AsyncIterator[Body]:
        cid, model = shapes.new_id(call.kind), call.body["model"]
        tool = self._tool_call(call)
        pieces = self._pieces(call) if tool is None else _split(tool["function"]["arguments"], self.spec.chunks)
        finish = "stop" if tool is None else "tool_calls"
        for i, piece in enumerate(pieces):
            if self.spec.die_after_chunks is not None and i >= self.spec.die_after_chunks:
                raise UpstreamError(f"scripted stream died after {i} chunks", retryable=False)
            if i and self.spec.chunk_delay_s:
                await asyncio.sleep(self.spec.chunk_delay_s)
            last = i == len(pieces) - 1
            if tool is None:
                yield shapes.chunk(call.kind, cid, model, piece, finish if last else None, first=i == 0)
                continue
            # the call's id and name in its first delta, its arguments piece by piece (as engines send them)
            delta = {"index": 0, "function": {"arguments": piece}}
            if i == 0:
                delta.update(
                    id=tool["id"], type="function", function={"name": tool["function"]["name"], "arguments": piece}
                )
            out = shapes.chunk(call.kind, cid, model, None, finish if last else None, first=i == 0)
            out["choices"][0]["delta"]["tool_calls"] = [delta]
            yield out
        options = call.body.get("stream_options") or {}
        if options.get("include_usage") and self.spec.stream_usage:
            yield shapes.usage_chunk(call.kind, cid, model, self._usage(call))


def factory(name: str, spec: Any) -> ScriptedBackend:
    return ScriptedBackend(name, spec)


def _split(text: str, n: int) -> list[str]:
    """``text`` in ``n`` pieces at most (one empty piece for no text)."""
    size = max(1, -(-len(text) // n))
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _last_text(body: Body) -> str:
    """The last message's text (a chat body), or the prompt (a completion body)."""
    if isinstance(prompt := body.get("prompt"), str):
        return prompt
    messages = body.get("messages") or [{}]
    content = messages[-1].get("content") if isinstance(messages[-1], dict) else None
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""
