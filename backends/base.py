"""The Backend protocol and the domain types that cross it.

A backend receives an OpenAI request body (chat or completion, ``model`` already set to the
engine's own name) and answers with an OpenAI response body, or with a stream of chunk bodies.
Retries, replica choice and health stay inside the backend; model fallback is the gateway's.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Kind = Literal["chat", "completion", "embedding"]
Body = dict[str, Any]


@dataclass(frozen=True)
class Capabilities:
    chat: bool = True
    completions: bool = True
    streaming: bool = True
    n_choices: bool = True  # n > 1
    logprobs: bool = True
    tools: bool = True
    images: bool = True  # image parts in a chat message
    json_schema: bool = True  # response_format json_schema (a local engine: by grammar)
    embeddings: bool = False  # POST /v1/embeddings passed through to the engine


@dataclass
class Attempt:
    """One try at one replica, for logs and metrics."""

    backend: str
    replica: str
    outcome: str  # "ok", "connect_error", "http_5xx", "timeout", "rejected", "stream_error"
    latency_s: float


@dataclass(frozen=True)
class Call:
    kind: Kind
    body: Body
    request_id: str
    attempts: list[Attempt] = field(default_factory=list)  # every try, appended by backends
    affinity: str | None = None  # requests with the same key prefer the same replica (prefix cache)
    background: bool = False  # a Batch API line: only a replica with spare room takes it (online first)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Completion:
    body: Body
    replica: str


class ChunkStream:
    """An opened stream: its first chunk has already arrived (so failover is over).

    ``aclose`` must be called (it is idempotent); ``cleanup`` releases what the backend holds
    even when the rest of the stream was never iterated.
    """

    def __init__(
        self,
        first: Body,
        rest: AsyncIterator[Body],
        replica: str,
        cleanup: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.first = first
        self._rest = rest
        self.replica = replica
        self._cleanup = cleanup

    async def __aiter__(self) -> AsyncIterator[Body]:
        yield self.first
        async for chunk in self._rest:
            yield chunk

    async def aclose(self) -> None:
        aclose = getattr(self._rest, "aclose", None)
        if aclose is not None:
            await aclose()
        if self._cleanup is not None:
            await self._cleanup()


@runtime_checkable
class Backend(Protocol):
    name: str
    capabilities: Capabilities

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def healthy(self) -> bool: ...

    async def complete(self, call: Call) -> Completion: ...

    async def open_stream(self, call: Call) -> ChunkStream: ...

    async def context_length(self, upstream: str) -> int | None:
        """The tokens the engine takes for the model it serves as ``upstream``, prompt and completion
        together, where it says (None where it does not, or cannot be asked now)."""
        ...


class Stopwatch:
    __slots__ = ("t0",)

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0
