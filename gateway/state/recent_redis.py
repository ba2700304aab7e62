"""The console's recent traffic, shared by every gateway on one Redis (``state.store: redis``) and
kept across restarts: a bounded list of each answered request's summary (``gateway.obs.recent.
summary``: id, time, surface, model, what answered, status, latency, cost, key name, and a prompt's
prefix only where the policy logs prompts), newest first, at most ``console.recent`` of them.

Written off the request's path (``gateway/state/buffered.py``): :meth:`RecentFeed.push` only
appends to a bounded buffer, and one task per gateway drains it every ``flush_s`` in one round
trip (``LPUSH`` of the batch, ``LTRIM`` to the bound, the fleet's count ``INCRBY``), so a request
never waits on Redis. A write that fails (Redis down or slow) is logged once per outage and
counted (``failed``), its summaries dropped: the ring is a view, and the gateway's own ring
(``gateway.obs.recent``) still has them. A buffer full while Redis is slow drops the newest
(``dropped``).

Read by the console's traffic and request pages (:meth:`latest`, :meth:`since`, :meth:`find`),
each read a :class:`StoreDown` when Redis fails (the console then shows this process's ring).
"""

from __future__ import annotations

from typing import Any

import orjson
import structlog

from gateway.state.buffered import Buffered
from gateway.state.stores import RedisStore, StoreDown

log = structlog.get_logger("triage.state")
Summary = dict[str, Any]
CHUNK = 500  # entries read at once when scanning back in time


class RecentFeed(Buffered[Summary]):
    def __init__(self, store: RedisStore, size: int = 2000, flush_s: float = 0.2) -> None:
        super().__init__(flush_s, "recent-feed")
        self.store = store
        self.size = size
        self.key = store.key("recent")
        self.total_key = store.key("recent-total")
        self.written = 0  # summaries written to Redis by this gateway
        self.failed = 0  # summaries dropped because a write failed
        self._down = False  # the last write failed (logged once per outage)

    def push(self, item: Summary) -> None:
        """Keep ``item`` (one request's summary) for the next write; never waits."""
        self.buffer(item)

    async def write(self, batch: list[Summary]) -> None:
        pipe = self.store.redis.pipeline(transaction=False)  # one round trip; another's LTRIM bounds it too
        pipe.lpush(self.key, *(orjson.dumps(s) for s in batch))
        pipe.ltrim(self.key, 0, self.size - 1)
        pipe.incrby(self.total_key, len(batch))
        try:
            await self.store.run(pipe.execute())
        except StoreDown as exc:
            self.failed += len(batch)
            if not self._down:
                log.warning("recent_feed_failed", error=exc.message, dropped=len(batch))
            self._down = True
            return
        if self._down:
            log.info("recent_feed_back", failed=self.failed)
        self._down = False
        self.written += len(batch)

    async def close(self) -> None:
        """What is buffered written (at most one round), then the drain stopped."""
        await self.flushed()

    async def latest(self, n: int) -> list[Summary]:
        """The ``n`` latest of the fleet, newest first."""
        return _decoded(await self.store.run(self.store.redis.lrange(self.key, 0, max(0, n - 1))))

    async def since(self, t: float, slack_s: float = 5.0) -> list[Summary]:
        """Those that finished after ``t``, oldest first: read back from the newest until an entry
        older than ``t`` by ``slack_s`` (gateways' batches interleave: the list is nearly in order)."""
        out: list[Summary] = []
        start = 0
        while start < self.size:
            chunk = _decoded(await self.store.run(self.store.redis.lrange(self.key, start, start + CHUNK - 1)))
            out += [s for s in chunk if _at(s) > t]
            if len(chunk) < CHUNK or any(_at(s) < t - slack_s for s in chunk):
                break
            start += CHUNK
        out.sort(key=_at)
        return out

    async def find(self, request_id: str, key: str | None = None) -> Summary | None:
        """The latest entry with this id (of the key named ``key``, where given)."""
        start = 0
        while start < self.size:
            chunk = _decoded(await self.store.run(self.store.redis.lrange(self.key, start, start + CHUNK - 1)))
            for s in chunk:
                if s.get("request_id") == request_id and (key is None or s.get("key") == key):
                    return s
            if len(chunk) < CHUNK:
                break
            start += CHUNK
        return None

    async def total(self) -> int:
        """Requests the fleet's gateways have written since the ring began."""
        raw = await self.store.run(self.store.redis.get(self.total_key))
        return int(raw or 0)


def _at(s: Summary) -> float:
    at = s.get("at")
    return float(at) if isinstance(at, int | float) else 0.0


def _decoded(raw: list[bytes]) -> list[Summary]:
    out = []
    for item in raw:
        try:
            value = orjson.loads(item)
        except orjson.JSONDecodeError:
            continue  # not ours: skipped
        if isinstance(value, dict):
            out.append(value)
    return out
