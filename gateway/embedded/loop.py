"""An event loop of its own in a background thread, for synchronous callers: a coroutine handed to
:meth:`LoopThread.run` from any thread (one with no loop, or one whose own loop must not be
blocked by the gateway's) runs there, and its result or its error comes back. The runtime's
objects (backends, engines' pipes, the micro-batchers' futures) live on that one loop, so every
call of one gateway goes through it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """A running event loop in a daemon thread, from construction to :meth:`close`."""

    def __init__(self, name: str = "triage-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """``work`` run to its end on the loop; the caller waits. Interrupted (Ctrl-C), the work is
        cancelled and the interruption goes on."""
        if threading.current_thread() is self._thread:
            work.close()
            raise RuntimeError("LoopThread.run was called from its own loop: await the coroutine instead")
        future = asyncio.run_coroutine_threadsafe(work, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and wait for its thread (as ``asyncio.run``
        ends a loop: tasks cancelled and awaited, async generators and the default executor shut)."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self.run(_wind_down())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()


async def _wind_down() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    loop = asyncio.get_running_loop()
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()
