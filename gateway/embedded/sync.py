"""The gateway in a program's own process, synchronous: :class:`Gateway` is an
:class:`~gateway.embedded.aio.AsyncGateway` run on a loop of its own in a background thread
(:class:`~gateway.embedded.loop.LoopThread`), so a program with no event loop (a script, a
notebook, a worker of a thread pool) calls the same verbs and gets the same answers and errors."""

from __future__ import annotations

import os
from collections.abc import Coroutine, Mapping
from types import TracebackType
from typing import Any, Literal, TypeVar

from gateway.embedded.aio import AsyncGateway, PolicySource, Prompt, Routing
from gateway.embedded.loop import LoopThread
from gateway.service.runtime import Runtime
from policies.cascade import Decision
from policies.errors import NotReady
from policies.schema import Policy

T = TypeVar("T")


class Gateway:
    """A policy served in-process, synchronously: the verbs of :class:`AsyncGateway`, blocking.
    ``with Gateway("policy.yaml") as gw:`` starts the runtime (its local engines in their worker
    processes) and stops it at the end of the block; see :class:`AsyncGateway` for the arguments."""

    def __init__(self, policy: PolicySource, *, base_dir: str | os.PathLike[str] | None = None, engines: bool = True):
        self._aio = AsyncGateway(policy, base_dir=base_dir, engines=engines)
        self._thread: LoopThread | None = None

    @property
    def policy(self) -> Policy:
        return self._aio.policy

    @property
    def runtime(self) -> Runtime:
        """The started runtime (its objects live on the gateway's own loop)."""
        return self._aio.runtime

    def open(self) -> Gateway:
        """Start the loop's thread and the runtime on it; once."""
        if self._thread is not None:
            raise NotReady("this gateway is open already")
        thread = LoopThread()
        try:
            thread.run(self._aio.open())
        except BaseException:
            thread.close()
            raise
        self._thread = thread
        return self

    def close(self) -> None:
        """Stop the runtime, then the loop's thread."""
        thread, self._thread = self._thread, None
        if thread is not None:
            try:
                thread.run(self._aio.aclose())
            finally:
                thread.close()

    def __enter__(self) -> Gateway:
        return self.open()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        """``work`` run on the gateway's loop (where its runtime lives), waited for."""
        if self._thread is None:
            work.close()
            raise NotReady("the gateway is not open: use `with Gateway(...)`, or call open()")
        return self._thread.run(work)

    def generate(
        self, body: Mapping[str, Any] | None = None, /, *, kind: Literal["chat", "completion"] = "chat", **fields: Any
    ) -> dict[str, Any]:
        """:meth:`AsyncGateway.generate`, blocking."""
        return self.run(self._aio.generate(body, kind=kind, **fields))

    def decide(self, body: Mapping[str, Any] | None = None, /, **fields: Any) -> Decision:
        """:meth:`AsyncGateway.decide`, blocking."""
        return self.run(self._aio.decide(body, **fields))

    def embed(self, body: Mapping[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
        """:meth:`AsyncGateway.embed`, blocking."""
        return self.run(self._aio.embed(body, **fields))

    def route(self, prompt: Prompt, model: str | None = None) -> Routing:
        """:meth:`AsyncGateway.route`, blocking."""
        return self.run(self._aio.route(prompt, model))
