"""The tenancy's state beside the keys' (``gateway.state.stores``): the teams the admin API made and
the audit log of admin actions, kept in the same store, so every gateway sharing it (Redis) sees
the same teams and one log. The memory store's (one process) are kept in memory.

Teams: a hash, name -> the team's record (JSON). Token callers: a hash, subject -> who it is (its
name, team and user: what a batch it made runs as on any gateway). The audit log: a Redis stream,
its oldest entries leaving past about :data:`AUDIT_MOST`; read newest first.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Protocol

import orjson

from gateway.state.stores import RedisStore, Store

AUDIT_MOST = 100_000  # audit entries kept (Redis trims the oldest, approximately)
AUDIT_MEMORY = 10_000  # kept by one process without a shared store


class Tenancy(Protocol):
    async def team_put(self, name: str, record: str, new: bool) -> bool:
        """Keep a team's record (JSON); ``new``: only when no team has that name (False: one has)."""
        ...

    async def team_get(self, name: str) -> str | None: ...

    async def team_all(self) -> dict[str, str]: ...

    async def team_delete(self, name: str) -> bool: ...

    async def caller_put(self, subject: str, record: str) -> None:
        """Keep who a token's subject is (its key as made on the fly, JSON): what a batch it made runs as."""
        ...

    async def caller_get(self, subject: str) -> str | None: ...

    async def audit_add(self, entry: dict[str, Any]) -> None: ...

    async def audit_read(self, most: int) -> list[dict[str, Any]]:
        """The newest ``most`` entries, newest first."""
        ...


class MemoryTenancy:
    def __init__(self) -> None:
        self._teams: dict[str, str] = {}
        self._callers: dict[str, str] = {}
        self._audit: deque[dict[str, Any]] = deque(maxlen=AUDIT_MEMORY)

    async def team_put(self, name: str, record: str, new: bool) -> bool:
        if new and name in self._teams:
            return False
        self._teams[name] = record
        return True

    async def team_get(self, name: str) -> str | None:
        return self._teams.get(name)

    async def team_all(self) -> dict[str, str]:
        return dict(self._teams)

    async def team_delete(self, name: str) -> bool:
        return self._teams.pop(name, None) is not None

    async def caller_put(self, subject: str, record: str) -> None:
        self._callers[subject] = record

    async def caller_get(self, subject: str) -> str | None:
        return self._callers.get(subject)

    async def audit_add(self, entry: dict[str, Any]) -> None:
        self._audit.append(entry)

    async def audit_read(self, most: int) -> list[dict[str, Any]]:
        return list(self._audit)[::-1][:most]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisTenancy:
    """Teams and the audit log on the store's Redis, under its prefix, within its timeout."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._r = store.redis
        self._teams = store.key("teams")
        self._audit = store.key("audit")
        self._callers = store.key("callers")

    async def team_put(self, name: str, record: str, new: bool) -> bool:
        if new:
            return bool(await self._store.run(self._r.hsetnx(self._teams, name, record)))
        await self._store.run(self._r.hset(self._teams, name, record))
        return True

    async def team_get(self, name: str) -> str | None:
        raw = await self._store.run(self._r.hget(self._teams, name))
        return None if raw is None else _text(raw)

    async def team_all(self) -> dict[str, str]:
        rows = await self._store.run(self._r.hgetall(self._teams))
        return {_text(k): _text(v) for k, v in rows.items()}

    async def team_delete(self, name: str) -> bool:
        return bool(await self._store.run(self._r.hdel(self._teams, name)))

    async def caller_put(self, subject: str, record: str) -> None:
        await self._store.run(self._r.hset(self._callers, subject, record))

    async def caller_get(self, subject: str) -> str | None:
        raw = await self._store.run(self._r.hget(self._callers, subject))
        return None if raw is None else _text(raw)

    async def audit_add(self, entry: dict[str, Any]) -> None:
        item = orjson.dumps(entry)
        await self._store.run(self._r.xadd(self._audit, {"e": item}, maxlen=AUDIT_MOST, approximate=True))

    async def audit_read(self, most: int) -> list[dict[str, Any]]:
        rows: Any = await self._store.run(self._r.xrevrange(self._audit, count=most))
        out = []
        for _, fields in rows or []:
            raw = fields.get(b"e", fields.get("e"))
            if raw is not None:
                out.append(orjson.loads(raw))
        return out


_OPENED: weakref.WeakKeyDictionary[Any, Tenancy] = weakref.WeakKeyDictionary()


def open_tenancy(store: Store) -> Tenancy:
    """The tenancy's state on ``store``'s engine: Redis's when the store is Redis, else this process's;
    one per store, so a reload that keeps the store keeps its teams and audit log."""
    found = _OPENED.get(store)
    if found is None:
        found = _OPENED[store] = RedisTenancy(store) if isinstance(store, RedisStore) else MemoryTenancy()
    return found
