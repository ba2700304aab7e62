"""The ``scripted`` backend: real code paths, behaviour fixed by typed policy fields.

Used by tests and demos: fixed text (or a reply chosen by what the last message contains),
latency before the first byte, the first N calls failing, a stream that dies after N chunks.
Token counts are whitespace words (it has no tokenizer).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson

from backends import shapes
from backends.base import Attempt, Body, Call, Capabilities, ChunkStream, Completion, Stopwatch
from backends.registry import register
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

    async def complete(self, call: Call) -> Completion:
        watch = await self._begin(call)
        n = int(call.body.get("n") or 1)
        body = shapes.response(call.kind, call.body["model"], [self._text(call)] * n, "stop", self._usage(call))
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
        pieces = self._pieces(call)
        for i, piece in enumerate(pieces):
            if self.spec.die_after_chunks is not None and i >= self.spec.die_after_chunks:
                raise UpstreamError(f"scripted stream died after {i} chunks", retryable=False)
            if i and self.spec.chunk_delay_s:
                await asyncio.sleep(self.spec.chunk_delay_s)
            last = i == len(pieces) - 1
            yield shapes.chunk(call.kind, cid, model, piece, "stop" if last else None, first=i == 0)
        options = call.body.get("stream_options") or {}
        if options.get("include_usage"):
            yield shapes.usage_chunk(call.kind, cid, model, self._usage(call))


@register("scripted")
def _build(name: str, spec: Any) -> ScriptedBackend:
    return ScriptedBackend(name, spec)


def _last_text(body: Body) -> str:
    """The last message's text (a chat body), or the prompt (a completion body)."""
    if isinstance(prompt := body.get("prompt"), str):
        return prompt
    messages = body.get("messages") or [{}]
    content = messages[-1].get("content") if isinstance(messages[-1], dict) else None
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""
