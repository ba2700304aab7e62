"""The state store: what several requests, or several gateways, share (a key's rate windows and
spend). One small interface, two engines chosen by the policy's ``state.store``:

- ``memory``: this process only (the embedded default; nothing to run);
- ``redis``: every gateway pointing at the same Redis shares it. Each check-and-count is one Lua
  script, so it is atomic across gateways, and reads Redis's own clock, so gateways whose clocks
  differ still share one window.

A store call that fails or takes longer than ``state.timeout_s`` raises :class:`StoreDown` (503):
a limit that cannot be checked is not passed (fail closed), and nothing is half-written (each
write is one command or one script).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from backends.secrets import MissingSecret, resolve
from policies.errors import NotReady
from policies.schema import StateSpec

T = TypeVar("T")
SPEND_TTL_S = 400 * 86400  # a day's spend is kept a little over a year


class StoreDown(NotReady):
    default_code = "state_store_unavailable"


class Store(Protocol):
    async def admit(self, window: str, limit: int, window_s: float) -> float | None:
        """Count one request in ``window`` unless ``limit`` are already in the last ``window_s``
        seconds; None when counted, else the seconds until a slot frees."""
        ...

    async def used(self, window: str, window_s: float) -> int:
        """The amount added to ``window`` in the last ``window_s`` seconds."""
        ...

    async def add(self, window: str, amount: int, window_s: float) -> None: ...

    async def add_spend(self, key: str, model: str, day: str, amount: float) -> None: ...

    async def spend(self, key: str, days: list[str]) -> dict[str, dict[str, float]]:
        """``{day: {model: amount}}`` for the days that have any."""
        ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


class MemoryStore:
    """One process's state (asyncio: every method runs on the loop, so each is atomic)."""

    def __init__(self) -> None:
        self._windows: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._spend: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def _trim(self, window: str, window_s: float, now: float) -> deque[tuple[float, int]]:
        q = self._windows[window]
        while q and q[0][0] <= now - window_s:
            q.popleft()
        return q

    async def admit(self, window: str, limit: int, window_s: float) -> float | None:
        now = time.time()
        q = self._trim(window, window_s, now)
        if len(q) >= limit:
            return max(q[0][0] + window_s - now, 0.001)
        q.append((now, 1))
        return None

    async def used(self, window: str, window_s: float) -> int:
        return sum(n for _, n in self._trim(window, window_s, time.time()))

    async def add(self, window: str, amount: int, window_s: float) -> None:
        self._trim(window, window_s, time.time()).append((time.time(), amount))

    async def add_spend(self, key: str, model: str, day: str, amount: float) -> None:
        self._spend[(key, day)][model] += amount

    async def spend(self, key: str, days: list[str]) -> dict[str, dict[str, float]]:
        return {d: dict(self._spend[(key, d)]) for d in days if (key, d) in self._spend}

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


# KEYS[1]: the window's sorted set; ARGV: window seconds, limit, a unique member. Redis's clock.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local w = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - w)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return tostring(math.max(tonumber(oldest[2]) + w - now, 0.001))
end
redis.call('ZADD', KEYS[1], now, ARGV[3] .. ':1')
redis.call('PEXPIRE', KEYS[1], math.ceil(w * 1000) + 1000)
return false
"""
# KEYS[1]; ARGV: window seconds, amount (0: only read), a unique member. Returns the sum in the window.
_ADD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local w = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - w)
if tonumber(ARGV[2]) > 0 then
  redis.call('ZADD', KEYS[1], now, ARGV[3] .. ':' .. ARGV[2])
  redis.call('PEXPIRE', KEYS[1], math.ceil(w * 1000) + 1000)
end
local total = 0
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  total = total + tonumber(string.match(m, ':(%d+)$'))
end
return total
"""


class RedisStore:
    """State shared by every gateway on one Redis (``redis``'s asyncio client)."""

    def __init__(self, url: str, prefix: str, timeout_s: float) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._prefix, self._timeout_s = prefix, timeout_s
        self._admit = self._redis.register_script(_ADMIT)
        self._add = self._redis.register_script(_ADD)
        self.where = url.split("://", 1)[-1].split("@")[-1]  # host:port/db: no password in messages

    async def _call(self, what: Awaitable[T]) -> T:
        from redis.exceptions import RedisError

        try:
            return await asyncio.wait_for(what, self._timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreDown(f"the state store (redis at {self.where}) failed: {type(exc).__name__}: {exc}") from None

    def _k(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    async def admit(self, window: str, limit: int, window_s: float) -> float | None:
        out = await self._call(self._admit(keys=[self._k("w", window)], args=[window_s, limit, uuid.uuid4().hex]))
        return None if out is None else float(out)

    async def used(self, window: str, window_s: float) -> int:
        return int(await self._call(self._add(keys=[self._k("w", window)], args=[window_s, 0, ""])))

    async def add(self, window: str, amount: int, window_s: float) -> None:
        if amount > 0:
            await self._call(self._add(keys=[self._k("w", window)], args=[window_s, amount, uuid.uuid4().hex]))

    async def add_spend(self, key: str, model: str, day: str, amount: float) -> None:
        name = self._k("spend", key, day)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hincrbyfloat(name, model, amount)
        pipe.expire(name, SPEND_TTL_S)
        await self._call(pipe.execute())

    async def spend(self, key: str, days: list[str]) -> dict[str, dict[str, float]]:
        pipe = self._redis.pipeline(transaction=False)
        for d in days:
            pipe.hgetall(self._k("spend", key, d))
        rows: list[dict[Any, Any]] = await self._call(pipe.execute())
        return {
            d: {(m.decode() if isinstance(m, bytes) else m): float(v) for m, v in row.items()}
            for d, row in zip(days, rows, strict=True)
            if row
        }

    async def ping(self) -> None:
        await self._call(self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()


async def open_store(spec: StateSpec) -> tuple[Store, str | None]:
    """The policy's store, checked; and a problem to report when it is down but ``degraded`` lets
    the gateway start (every limited request then gets 503)."""
    if spec.store == "memory":
        return MemoryStore(), None
    try:
        url = resolve(spec.url) if spec.url and spec.url.startswith("env:") else spec.url
    except MissingSecret as exc:
        raise StoreDown(f"state.url: {exc}") from None
    assert url is not None, "validated: store redis has a url"
    store = RedisStore(url, spec.prefix, spec.timeout_s)
    try:
        await store.ping()
    except StoreDown as exc:
        if not spec.degraded:
            await store.close()
            raise
        return store, exc.message
    return store, None
