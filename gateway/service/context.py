"""What the service knows of one request besides its body: who asked, its id, the attempts it
made upstream (for the log and the metrics), which surface it came in by, and how a wait for an
engine is awaited (a client that leaves stops it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from backends.base import Attempt
from backends.crash_guard import Caller, calling
from policies.response_cache import Directive
from policies.schema import ApiKey

T = TypeVar("T")


class Wait(Protocol):
    """How a request awaits work that may take long (the edge stops it when the client leaves)."""

    def __call__(self, work: Awaitable[T]) -> Awaitable[T]: ...


@dataclass(slots=True)
class Context:
    request_id: str
    attempts: list[Attempt] = field(default_factory=list)
    key: ApiKey | None = None  # the caller's: a model tier it may not reach is skipped
    surface: str = "chat"  # the door it came in by: chat, completions, responses, messages, decide, batch, ...
    affinity: str | None = None  # a replica hint (a batch's prefix group)
    wait: Wait | None = None  # None: awaited as is
    cache: Directive | None = None  # the request's `x-triage-cache` header: allow, refresh, bypass
    session: str | None = None  # the request's `x-session-id` header: a split's sticky id (sticky: session)

    def item(self, i: int) -> Context:
        """The context of the ``i``-th item of a batch of questions: its own id, the same attempts."""
        return dataclasses.replace(self, request_id=f"{self.request_id}-{i}")

    def waited(self, work: Awaitable[T]) -> Awaitable[T]:
        """``work`` as this request awaits it: the local engines know whose it is (a key's crashes
        slow it: ``backends.crash_guard``), and the edge stops it when the client leaves. No
        coroutine of its own without a key or a watch: the hot path's frames are few."""
        if self.key is not None:
            work = _as(Caller(self.key.name, self.key.sha256), work)
        return work if self.wait is None else self.wait(work)


async def _as(caller: Caller, work: Awaitable[T]) -> T:
    with calling(caller):
        return await work
