"""Several gateways, one view of the replicas' caches: what each gateway sends where is told to
the others through the fleet's shared store, and added to each one's prefix index.

The engines' own counters are each gateway's truth for load (each reads them itself,
``backends/engine_poll.py``); the approximate index of what each replica's cache holds is built
from what the gateways sent, so they share it: every ``flush_s`` a gateway appends what it sent
since (replica, block hashes) to a feed of the state store (a Redis stream,
``Store.feed_add``/``feed_read``: the one the semantic cache uses), and reads the other gateways'
additions. A prefix one gateway sent to a replica is in every gateway's index within about
``flush_s`` plus ``read_s``: two gateways then make the same choice for it.

A store that fails is logged and tried again at the next round: the index is a hint, and a
gateway without the others' part only chooses less well, never wrongly.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, Protocol

import orjson
import structlog

from backends.replicas import ReplicaSet

log = structlog.get_logger("triage.backend")


class Feed(Protocol):
    async def feed_add(self, name: str, item: bytes, most: int = 100_000) -> None: ...

    async def feed_read(self, name: str, after: str, most: int = 1000) -> tuple[str, list[bytes]]: ...


class IndexFeed:
    def __init__(
        self, backend: str, replicas: ReplicaSet, store: Feed, *, flush_s: float = 0.1, read_s: float = 0.1
    ) -> None:
        self.name = f"dispatch:{backend}"
        self.backend = backend
        self.replicas = replicas
        self.store = store
        self.flush_s = flush_s
        self.read_s = read_s
        self.me = uuid.uuid4().hex[:12]
        self._out: list[tuple[str, tuple[int, ...]]] = []
        self._after = "0"  # from the feed's start: a gateway that starts late learns what was sent before
        self._tasks: list[asyncio.Task[None]] = []
        self.applied = 0  # others' additions taken into the index
        replicas.shared = self._sent

    def _sent(self, i: int, hashes: tuple[int, ...]) -> None:
        if len(self._out) < 10_000:  # a store down for long: the oldest hints are enough
            self._out.append((self.replicas.replicas[i].api_base, hashes))

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._every(self.flush_s, self.flush), name=f"index-out:{self.backend}"),
            asyncio.create_task(self._every(self.read_s, self.read), name=f"index-in:{self.backend}"),
        ]

    async def close(self) -> None:
        if self.replicas.shared == self._sent:
            self.replicas.shared = None
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []

    async def _every(self, period: float, step: Any) -> None:
        while True:
            try:
                await step()
            except Exception as exc:  # the store down or slow: the next round tries again
                log.warning("index_feed_failed", backend=self.backend, error=f"{type(exc).__name__}: {exc}"[:200])
            await asyncio.sleep(period)

    async def flush(self) -> None:
        if not self._out:
            return
        out, self._out = self._out, []
        await self.store.feed_add(self.name, orjson.dumps({"g": self.me, "s": out}), most=50_000)

    async def read(self) -> None:
        after, items = await self.store.feed_read(self.name, self._after)
        self._after = after
        for raw in items:
            try:
                item = orjson.loads(raw)
                if item.get("g") == self.me:
                    continue
                for base, hashes in item["s"]:
                    i = self.replicas.position.get(base)
                    if i is not None and all(isinstance(h, int) for h in hashes):
                        self.replicas.index.add(i, tuple(hashes))
                        self.applied += 1
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                log.warning("index_feed_item_malformed", backend=self.backend)
