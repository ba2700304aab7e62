"""One worker thread at a time for an object that is not thread-safe (a llama.cpp context)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Serial:
    """Runs functions in worker threads, one at a time. The lock is held until the THREAD is
    done, not until the caller stops waiting: a timed-out or cancelled caller must not let a
    second call into the same context while the first is still running."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()

    async def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        await self.lock.acquire()
        try:
            fut = asyncio.get_running_loop().run_in_executor(None, fn)
        except BaseException:
            self.lock.release()
            raise

        def done(f: asyncio.Future[T]) -> None:
            self.lock.release()
            if not f.cancelled():
                f.exception()  # retrieved here, so an abandoned failure is not reported as unhandled

        fut.add_done_callback(done)
        return fut

    async def run(self, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn``'s result; TimeoutError after ``timeout_s`` (the thread still finishes first)."""
        fut = await self.submit(fn)
        async with asyncio.timeout(timeout_s):
            return await asyncio.shield(fut)
