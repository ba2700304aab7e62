"""The state store: what several requests, or several gateways, share (a key's rate windows and
spend, the keys the admin API made, typed decisions cached). One small interface, two engines
chosen by the policy's ``state.store``:

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
from collections import OrderedDict, defaultdict, deque
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

    async def key_create(self, name: str, digest: str, record: str) -> bool:
        """Keep a new key's record (JSON) under its sha256 and make it the name's live key; False when
        the name already has a live key (nothing written)."""
        ...

    async def key_rotate(self, name: str, digest: str, record: str, revoke_at: float) -> str | None:
        """A new live key for ``name``; the old one is revoked at ``revoke_at`` (epoch seconds). The
        old key's sha256, or None when the name has no live key (nothing written)."""
        ...

    async def key_revoke(self, name: str, at: float) -> str | None:
        """The name's live key revoked at ``at``; its sha256, None when it has none."""
        ...

    async def key_get(self, digest: str) -> tuple[str | None, float | None]:
        """A key's record (JSON) and when it is or was revoked; (None, None) for an unknown key."""
        ...

    async def key_all(self) -> list[tuple[str, float | None]]:
        """Every key's record and revocation time, revoked ones too."""
        ...

    async def cache_get(self, key: str) -> bytes | None: ...

    async def cache_put(self, key: str, value: bytes, ttl_s: float) -> None: ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


class MemoryStore:
    """One process's state (asyncio: every method runs on the loop, so each is atomic)."""

    def __init__(self, cache_entries: int = 100_000) -> None:
        self._windows: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._spend: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._keys: dict[str, str] = {}  # sha256 -> record
        self._names: dict[str, str] = {}  # name -> its live key's sha256
        self._revoked: dict[str, float] = {}  # sha256 -> when
        self._cache: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expires, value): LRU
        self._cache_entries = cache_entries

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

    async def key_create(self, name: str, digest: str, record: str) -> bool:
        if name in self._names:
            return False
        self._names[name], self._keys[digest] = digest, record
        return True

    async def key_rotate(self, name: str, digest: str, record: str, revoke_at: float) -> str | None:
        old = self._names.get(name)
        if old is None:
            return None
        self._names[name], self._keys[digest], self._revoked[old] = digest, record, revoke_at
        return old

    async def key_revoke(self, name: str, at: float) -> str | None:
        old = self._names.pop(name, None)
        if old is not None:
            self._revoked[old] = at
        return old

    async def key_get(self, digest: str) -> tuple[str | None, float | None]:
        return self._keys.get(digest), self._revoked.get(digest)

    async def key_all(self) -> list[tuple[str, float | None]]:
        return [(record, self._revoked.get(digest)) for digest, record in self._keys.items()]

    async def cache_get(self, key: str) -> bytes | None:
        hit = self._cache.get(key)
        if hit is None:
            return None
        if hit[0] <= time.monotonic():
            del self._cache[key]
            return None
        self._cache.move_to_end(key)
        return hit[1]

    async def cache_put(self, key: str, value: bytes, ttl_s: float) -> None:
        self._cache[key] = (time.monotonic() + ttl_s, value)
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)

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


# Keys: KEYS = names (name -> live sha256), records (sha256 -> JSON), revoked (sha256 -> epoch s).
_KEY_CREATE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return 1
"""
_KEY_ROTATE = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return false end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[3], old, ARGV[4])
return old
"""
_KEY_REVOKE = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], old, ARGV[2])
return old
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStore:
    """State shared by every gateway on one Redis (``redis``'s asyncio client)."""

    def __init__(self, url: str, prefix: str, timeout_s: float) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._prefix, self._timeout_s = prefix, timeout_s
        self._admit = self._redis.register_script(_ADMIT)
        self._add = self._redis.register_script(_ADD)
        self._key_create = self._redis.register_script(_KEY_CREATE)
        self._key_rotate = self._redis.register_script(_KEY_ROTATE)
        self._key_revoke = self._redis.register_script(_KEY_REVOKE)
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

    def _key_sets(self) -> list[str]:
        return [self._k("keys", "names"), self._k("keys", "records"), self._k("keys", "revoked")]

    async def key_create(self, name: str, digest: str, record: str) -> bool:
        return bool(await self._call(self._key_create(keys=self._key_sets(), args=[name, digest, record])))

    async def key_rotate(self, name: str, digest: str, record: str, revoke_at: float) -> str | None:
        old = await self._call(self._key_rotate(keys=self._key_sets(), args=[name, digest, record, repr(revoke_at)]))
        return None if old is None else _text(old)

    async def key_revoke(self, name: str, at: float) -> str | None:
        old = await self._call(self._key_revoke(keys=self._key_sets(), args=[name, repr(at)]))
        return None if old is None else _text(old)

    async def key_get(self, digest: str) -> tuple[str | None, float | None]:
        _, records, revoked = self._key_sets()
        pipe = self._redis.pipeline(transaction=False)
        pipe.hget(records, digest)
        pipe.hget(revoked, digest)
        record, at = await self._call(pipe.execute())
        return (None if record is None else _text(record)), (None if at is None else float(at))

    async def key_all(self) -> list[tuple[str, float | None]]:
        _, records, revoked = self._key_sets()
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(records)
        pipe.hgetall(revoked)
        rows, ats = await self._call(pipe.execute())
        when = {_text(d): float(t) for d, t in ats.items()}
        return [(_text(r), when.get(_text(d))) for d, r in rows.items()]

    async def cache_get(self, key: str) -> bytes | None:
        value = await self._call(self._redis.get(self._k("cache", key)))
        return value.encode() if isinstance(value, str) else value

    async def cache_put(self, key: str, value: bytes, ttl_s: float) -> None:
        await self._call(self._redis.set(self._k("cache", key), value, px=max(1, int(ttl_s * 1000))))

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
