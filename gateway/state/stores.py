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
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from policies.errors import NotReady
from policies.schema import StateSpec
from policies.secrets import MissingSecret, resolve_secret

T = TypeVar("T")
SPEND_TTL_S = 400 * 86400  # a day's spend is kept a little over a year


class StoreDown(NotReady):
    default_code = "state_store_unavailable"


@dataclass(frozen=True)
class Check:
    """One request's limits for one key, checked and counted in one atomic store call."""

    key: str  # the key's name
    days: tuple[str, ...]  # the UTC days whose spend counts: today first, then the month's others
    budget_day: float | None = None
    budget_month: float | None = None
    tpm: int | None = None
    rpm: int | None = None
    window_s: float = 60.0


Refusal = tuple[str, float, float]


class Store(Protocol):
    async def check(self, c: Check) -> Refusal | None:
        """Check every limit of ``c`` and, when all pass, count one request against its rpm: one
        atomic step. None when counted; else what refused it, how much was used, and the seconds
        until the window frees some (0 for a budget): ``("day" | "month" | "tpm" | "rpm", used, wait)``."""
        ...

    async def check_all(self, checks: tuple[Check, ...]) -> tuple[int, Refusal] | None:
        """:meth:`check` for several subjects at once (a key and its team): every limit of each is
        checked, and only when all pass is one request counted against each one's rpm; else which
        of ``checks`` refused (its index) and why."""
        ...

    async def record(self, key: str, model: str, day: str, cost: float, tokens: int, window_s: float) -> None:
        """Add a served request's cost to the key's spend for the day and model, and its tokens to
        the key's tpm window: one write."""
        ...

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

    async def feed_add(self, name: str, item: bytes, most: int = 100_000) -> None:
        """Append ``item`` to the feed ``name`` that every gateway sharing the store reads (its
        oldest items leave past about ``most``); this process's store has no one else: a no-op."""
        ...

    async def feed_read(self, name: str, after: str, most: int = 1000) -> tuple[str, list[bytes]]:
        """Up to ``most`` items of the feed ``name`` added after the position ``after`` ("0": from
        the start), and the position to read from next."""
        ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


class MemoryStore:
    """One process's state (asyncio: every method runs on the loop, so each is atomic)."""

    def __init__(self, cache_entries: int = 100_000, cache_bytes: int = 256 << 20) -> None:
        self._windows: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._spend: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._keys: dict[str, str] = {}  # sha256 -> record
        self._names: dict[str, str] = {}  # name -> its live key's sha256
        self._revoked: dict[str, float] = {}  # sha256 -> when
        self._cache: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expires, value): LRU
        self._cache_entries, self._cache_bytes, self._cache_used = cache_entries, cache_bytes, 0

    def _trim(self, window: str, window_s: float, now: float) -> deque[tuple[float, int]]:
        q = self._windows[window]
        while q and q[0][0] <= now - window_s:
            q.popleft()
        return q

    async def check(self, c: Check) -> Refusal | None:
        refused = await self.check_all((c,))
        return None if refused is None else refused[1]

    async def check_all(self, checks: tuple[Check, ...]) -> tuple[int, Refusal] | None:
        now = time.time()
        for i, c in enumerate(checks):
            if (refused := self._refusal(c, now)) is not None:
                return i, refused
        for c in checks:
            if c.rpm is not None:
                self._trim(f"rpm:{c.key}", c.window_s, now).append((now, 1))
        return None

    def _refusal(self, c: Check, now: float) -> Refusal | None:
        by_day = [sum(self._spend[(c.key, d)].values()) if (c.key, d) in self._spend else 0.0 for d in c.days]
        if c.budget_day is not None and by_day and by_day[0] >= c.budget_day:
            return "day", by_day[0], 0.0
        if c.budget_month is not None and sum(by_day) >= c.budget_month:
            return "month", sum(by_day), 0.0
        if c.tpm is not None:
            q = self._trim(f"tpm:{c.key}", c.window_s, now)
            if (used := sum(n for _, n in q)) >= c.tpm:
                return "tpm", float(used), max(q[0][0] + c.window_s - now, 0.001)
        if c.rpm is not None:
            q = self._trim(f"rpm:{c.key}", c.window_s, now)
            if len(q) >= c.rpm:
                return "rpm", float(len(q)), max(q[0][0] + c.window_s - now, 0.001)
        return None

    async def record(self, key: str, model: str, day: str, cost: float, tokens: int, window_s: float) -> None:
        if cost > 0:
            self._spend[(key, day)][model] += cost
        if tokens > 0:
            self._trim(f"tpm:{key}", window_s, time.time()).append((time.time(), tokens))

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
            self._cache_used -= len(self._cache.pop(key)[1])
            return None
        self._cache.move_to_end(key)
        return hit[1]

    async def cache_put(self, key: str, value: bytes, ttl_s: float) -> None:
        """Kept for ``ttl_s``; the least recently used leave past the entries' or the bytes' bound."""
        if (old := self._cache.pop(key, None)) is not None:
            self._cache_used -= len(old[1])
        self._cache[key] = (time.monotonic() + ttl_s, value)
        self._cache_used += len(value)
        while self._cache and (len(self._cache) > self._cache_entries or self._cache_used > self._cache_bytes):
            self._cache_used -= len(self._cache.popitem(last=False)[1][1])

    async def feed_add(self, name: str, item: bytes, most: int = 100_000) -> None:
        return None  # one process: nobody else reads it

    async def feed_read(self, name: str, after: str, most: int = 1000) -> tuple[str, list[bytes]]:
        return after, []

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


# KEYS, per subject (a key, its team): its rpm window (sorted set), its tpm window, then the spend
# hashes of its days counted (today first). ARGV: window seconds, a unique member, then per subject:
# its number of days, rpm, tpm, day budget, month budget (0: none). Every subject is checked before
# any is counted. Redis's own clock, so gateways whose clocks differ share one window.
_CHECK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local w = tonumber(ARGV[1])
local k, a, i = 1, 3, 0
local counted = {}
while a <= #ARGV do
  local n, rpm, tpm = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local bday, bmonth = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local today, month = 0, 0
  for d = 1, n do
    local s = 0
    for _, v in ipairs(redis.call('HVALS', KEYS[k + 1 + d])) do s = s + tonumber(v) end
    if d == 1 then today = s end
    month = month + s
  end
  if bday > 0 and today >= bday then return {tostring(i), 'day', tostring(today), '0'} end
  if bmonth > 0 and month >= bmonth then return {tostring(i), 'month', tostring(month), '0'} end
  if tpm > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[k + 1], '-inf', now - w)
    local used = 0
    for _, m in ipairs(redis.call('ZRANGE', KEYS[k + 1], 0, -1)) do
      used = used + tonumber(string.match(m, ':(%d+)$'))
    end
    if used >= tpm then
      local oldest = redis.call('ZRANGE', KEYS[k + 1], 0, 0, 'WITHSCORES')
      return {tostring(i), 'tpm', tostring(used), tostring(math.max(tonumber(oldest[2]) + w - now, 0.001))}
    end
  end
  if rpm > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', now - w)
    local c = redis.call('ZCARD', KEYS[k])
    if c >= rpm then
      local oldest = redis.call('ZRANGE', KEYS[k], 0, 0, 'WITHSCORES')
      return {tostring(i), 'rpm', tostring(c), tostring(math.max(tonumber(oldest[2]) + w - now, 0.001))}
    end
    counted[#counted + 1] = KEYS[k]
  end
  k, a, i = k + 2 + n, a + 5, i + 1
end
for _, key in ipairs(counted) do
  redis.call('ZADD', key, now, ARGV[2] .. ':1')
  redis.call('PEXPIRE', key, math.ceil(w * 1000) + 1000)
end
return false
"""
# KEYS: the day's spend hash, the tpm window. ARGV: model, cost, spend TTL s, tokens, window s, member.
_RECORD = """
if tonumber(ARGV[2]) > 0 then
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[1], ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
if tonumber(ARGV[4]) > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[5]))
  redis.call('ZADD', KEYS[2], now, ARGV[6] .. ':' .. ARGV[4])
  redis.call('PEXPIRE', KEYS[2], math.ceil(tonumber(ARGV[5]) * 1000) + 1000)
end
return false
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
        self._check = self._redis.register_script(_CHECK)
        self._record = self._redis.register_script(_RECORD)
        self._key_create = self._redis.register_script(_KEY_CREATE)
        self._key_rotate = self._redis.register_script(_KEY_ROTATE)
        self._key_revoke = self._redis.register_script(_KEY_REVOKE)
        self.where = url.split("://", 1)[-1].split("@")[-1].split("?")[0]  # host:port/db: no password in messages

    @property
    def redis(self) -> Any:
        """The client, for a store kept beside this one (``gateway/state/responses_redis.py``)."""
        return self._redis

    def key(self, *parts: str) -> str:
        return self._k(*parts)

    async def run(self, what: Awaitable[T]) -> T:
        """A Redis call under this store's timeout; :class:`StoreDown` when it fails."""
        return await self._call(what)

    async def _call(self, what: Awaitable[T]) -> T:
        from redis.exceptions import RedisError

        try:
            return await asyncio.wait_for(what, self._timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreDown(f"the state store (redis at {self.where}) failed: {type(exc).__name__}: {exc}") from None

    def _k(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    async def check(self, c: Check) -> Refusal | None:
        refused = await self.check_all((c,))
        return None if refused is None else refused[1]

    async def check_all(self, checks: tuple[Check, ...]) -> tuple[int, Refusal] | None:
        keys: list[str] = []
        args: list[str | float] = [checks[0].window_s, uuid.uuid4().hex]
        for c in checks:
            keys += [self._k("w", f"rpm:{c.key}"), self._k("w", f"tpm:{c.key}")]
            keys += [self._k("spend", c.key, d) for d in c.days]
            args += [len(c.days), c.rpm or 0, c.tpm or 0, c.budget_day or 0, c.budget_month or 0]
        out = await self._call(self._check(keys=keys, args=args))
        return None if out is None else (int(_text(out[0])), (_text(out[1]), float(out[2]), float(out[3])))

    async def record(self, key: str, model: str, day: str, cost: float, tokens: int, window_s: float) -> None:
        keys = [self._k("spend", key, day), self._k("w", f"tpm:{key}")]
        args: list[str | float] = [model, repr(cost), SPEND_TTL_S, tokens, window_s, uuid.uuid4().hex]
        await self._call(self._record(keys=keys, args=args))

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

    async def feed_add(self, name: str, item: bytes, most: int = 100_000) -> None:
        await self._call(self._redis.xadd(self._k("feed", name), {"i": item}, maxlen=most, approximate=True))

    async def feed_read(self, name: str, after: str, most: int = 1000) -> tuple[str, list[bytes]]:
        got: Any = await self._call(self._redis.xread({self._k("feed", name): after}, count=most))
        items: list[bytes] = []
        for _, entries in got or []:  # [(stream, [(position, {field: value})])]
            for position, fields in entries:
                after = _text(position)
                value = fields.get(b"i", fields.get("i"))
                if value is not None:
                    items.append(value.encode() if isinstance(value, str) else value)
        return after, items

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
        url = resolve_secret(spec.url)
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
