"""Writes to the fleet's store kept off the request's path (the console's ring, the cascade's
memory): :meth:`Buffered.buffer` only appends to a bounded buffer, and one task per writer drains it
every ``flush_s`` in one round (the subclass's :meth:`Buffered.write`), so a request never waits on
Redis. A buffer full while Redis is slow drops the newest (``dropped``), as does a closed writer.
A write that fails is the subclass's to count and log."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")
MOST_PENDING = 10_000  # items waiting for Redis at most
CLOSE_WAIT_S = 5.0  # at close, the last write's time at most


class Buffered(Generic[T]):
    def __init__(self, flush_s: float, name: str) -> None:
        self.flush_s = flush_s
        self._name = name
        self._pending: deque[T] = deque()
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0  # items dropped because the buffer was full, or given after close
        self._closed = False

    def buffer(self, item: T) -> None:
        """Keep ``item`` for the next write; never waits. After :meth:`flushed` (a retired runtime's
        writer, its store maybe closed: a shadow check may finish after it) it is dropped."""
        if self._closed or len(self._pending) >= MOST_PENDING:
            self.dropped += 1
            return
        self._pending.append(item)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain(), name=self._name)

    async def _drain(self) -> None:
        try:
            while self._pending:
                await asyncio.sleep(self.flush_s)
                batch = list(self._pending)
                self._pending.clear()
                await self.write(batch)
        finally:
            self._task = None

    async def write(self, batch: list[T]) -> None:
        raise NotImplementedError

    async def flushed(self) -> None:
        """What is buffered written (at most one round), then the drain stopped; nothing is taken after."""
        self._closed = True
        task = self._task
        if task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), self.flush_s + CLOSE_WAIT_S)
            task.cancel()
