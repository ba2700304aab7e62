"""Micro-batching: concurrent ``await batcher.embed(text)`` calls share one encoder forward.

A collector task takes the first waiting prompt, then gathers more until ``max_batch`` prompts
are in hand or ``max_wait_ms`` have passed since that first prompt ARRIVED (prompts that queued
while the previous forward ran have already waited, so they go at once). The forward runs in
one dedicated worker thread, never on the event loop; its rows are handed back to the waiters in
order. If the forward raises, every waiter of that batch gets the exception. A waiter that was
cancelled before its batch ran is dropped from the batch.

``aclose()`` stops new calls (they raise NotReady), lets every queued prompt finish, then stops
the collector and the worker thread. Nothing starts before the first call (or ``start()``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Generic, TypeVar

from policies.errors import InvalidRequest, NotReady

T = TypeVar("T")
R = TypeVar("R")  # one result per prompt: an embedding row, or the encoder's Reading
Forward = Callable[[Sequence[T]], Sequence[R]]


@dataclass
class _Item(Generic[T, R]):
    text: T
    future: asyncio.Future[R]
    arrived: float


@dataclass
class BatchStats:
    batches: int = 0
    items: int = 0
    sizes: list[int] = field(default_factory=list)  # the last 1024 batch sizes

    def record(self, size: int) -> None:
        self.batches += 1
        self.items += size
        self.sizes.append(size)
        del self.sizes[:-1024]


class MicroBatcher(Generic[T, R]):
    def __init__(
        self,
        forward: Forward[T, R],
        *,
        max_batch: int = 16,
        max_wait_ms: float = 2.0,
        thread_name: str = "triage-encoder",
    ) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise InvalidRequest("micro-batching needs max_batch >= 1 and max_wait_ms >= 0")
        self._forward = forward
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self._thread_name = thread_name
        self._queue: asyncio.Queue[_Item[T, R] | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self.stats = BatchStats()

    def start(self) -> None:
        if self._closed:
            raise NotReady("the encoder batcher is closed")
        if self._task is None:
            self._queue = asyncio.Queue()
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
            self._task = asyncio.get_running_loop().create_task(self._collect(), name=self._thread_name)

    async def embed(self, text: T) -> R:
        """The forward's result for one prompt, computed in a shared batch."""
        self.start()
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        self._queue.put_nowait(_Item(text, fut, loop.time()))
        return await fut

    async def aclose(self) -> None:
        """Finish what is queued, then stop the collector and the worker thread."""
        if self._closed:
            return
        self._closed = True
        if self._task is None:
            return
        assert self._queue is not None and self._pool is not None
        self._queue.put_nowait(None)
        try:
            await self._task
        finally:
            self._pool.shutdown(wait=True)

    async def __aenter__(self) -> MicroBatcher[T, R]:
        self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _collect(self) -> None:
        try:
            await self._collect_batches()
        finally:  # cancelled (the loop is going away): nobody is left waiting forever
            self._closed = True
            while self._queue is not None and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is not None:
                    item.future.cancel()

    async def _collect_batches(self) -> None:
        assert self._queue is not None
        queue, loop = self._queue, asyncio.get_running_loop()
        stopping = False
        while not stopping:
            first = await queue.get()
            if first is None:
                return
            batch = [first]
            deadline = first.arrived + self.max_wait
            while len(batch) < self.max_batch:
                try:
                    item = queue.get_nowait()
                except asyncio.QueueEmpty:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(queue.get(), remaining)
                    except TimeoutError:
                        break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            await self._run(batch)

    async def _run(self, batch: list[_Item[T, R]]) -> None:
        live = [it for it in batch if not it.future.done()]
        if not live:
            return
        assert self._pool is not None
        self.stats.record(len(live))
        texts = [it.text for it in live]
        try:
            rows = await asyncio.get_running_loop().run_in_executor(self._pool, self._forward, texts)
        except asyncio.CancelledError:
            for it in live:
                it.future.cancel()
            raise
        except Exception as exc:  # not swallowed: handed to every waiter of this batch
            for it in live:
                if not it.future.done():
                    it.future.set_exception(exc)
            return
        if len(rows) != len(live):
            err = NotReady(f"encoder returned {len(rows)} rows for {len(live)} prompts")
            for it in live:
                if not it.future.done():
                    it.future.set_exception(err)
            return
        for it, row in zip(live, rows, strict=True):
            if not it.future.done():
                it.future.set_result(row)
