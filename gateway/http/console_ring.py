"""Which ring of recent requests the console's traffic and request pages read: the fleet's, where
the policy's state is shared (Redis: every gateway's requests, kept across restarts,
``gateway/state/recent_redis.py``), else this process's (``gateway.obs.recent``). Redis failing
falls back to this process's ring (logged), so the console keeps working; a full trace (the
decision, the route, each upstream try) is only in the ring of the process that answered, a
summary in the fleet's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from gateway.obs import recent
from gateway.obs.recent import Recent, Seen
from gateway.service.runtime import Runtime
from gateway.state.recent_redis import RecentFeed
from gateway.state.stores import StoreDown

log = structlog.get_logger("triage.console")
T = TypeVar("T")


async def _fleet(rt: Runtime, read: Callable[[RecentFeed], Awaitable[T]]) -> T | None:
    """``read`` of the fleet's ring; None where there is none, or Redis fails (logged)."""
    if rt.recent is None:
        return None
    try:
        return await read(rt.recent)
    except StoreDown as exc:
        log.warning("console_fleet_ring_unreadable", error=exc.message)
        return None


async def traffic(rt: Runtime, ring: Recent) -> dict[str, Any]:
    """The traffic page's numbers (:func:`gateway.obs.recent.traffic_of`): the fleet's last minute,
    with what this gateway wrote to it and failed to, else this process's (``scope`` says which)."""

    async def read(feed: RecentFeed) -> dict[str, Any]:
        now = ring.now()
        rows = [recent.from_summary(s) for s in await feed.since(now - recent.WINDOW_S)]
        latest = [recent.from_summary(s) for s in await feed.latest(20)]
        out = recent.traffic_of(rows, latest, await feed.total(), now, scope="fleet")
        out["feed"] = {"written": feed.written, "failed": feed.failed, "dropped": feed.dropped}
        return out

    return await _fleet(rt, read) or recent.traffic(ring)


async def latest(rt: Runtime, ring: Recent, n: int) -> tuple[list[Seen], bool]:
    """The ``n`` latest requests, newest first, and whether they are the fleet's."""
    fleet = await _fleet(rt, lambda feed: feed.latest(n))
    if fleet is None:
        return ring.latest(n), False
    return [recent.from_summary(s) for s in fleet], True


async def find(rt: Runtime, request_id: str, key: str | None) -> Seen | None:
    """A request another gateway answered, or this one before a restart: its summary in the
    fleet's ring (the caller looked in this process's ring first)."""
    found = await _fleet(rt, lambda feed: feed.find(request_id, key))
    return None if found is None else recent.from_summary(found)
