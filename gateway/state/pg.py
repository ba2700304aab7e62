"""What every PostgreSQL store shares (the batch store, the quality store): the DSN from the
policy's ``state.database``, a connection pool whose tables are created once whoever starts
first, and calls on pooled connections with a deadline, each failure :class:`StoreDown` naming
the server (host:port/database, never a password).

Imported only when the policy sets ``state.database`` (asyncpg is imported here).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import ClassVar, TypeVar

import asyncpg

from gateway.state.stores import StoreDown
from policies.errors import InvalidRequest
from policies.schema import StateSpec
from policies.secrets import MissingSecret, resolve_secret

T = TypeVar("T")
CONNECT_TIMEOUT_S = 5.0  # a connection (at start: the gateway does not start past it)
CALL_TIMEOUT_S = 10.0  # one store call


def insert(table: str, columns: tuple[str, ...]) -> str:
    """``INSERT INTO table (columns...) VALUES ($1, ...)``."""
    values = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({values})"


def database_dsn(spec: StateSpec) -> str:
    """The policy's ``state.database`` (set), its ``env:NAME`` read: :class:`StoreDown` when unset."""
    try:
        dsn = resolve_secret(spec.database)
    except MissingSecret as exc:
        raise StoreDown(f"state.database: {exc}") from None
    assert dsn is not None, "called when state.database is set"
    return dsn


def where_of(dsn: str) -> str:
    """host:port/database of a DSN, for messages: never its user, password or parameters."""
    return dsn.split("://", 1)[-1].split("@")[-1].split("?")[0]


async def open_pool(dsn: str, what: str, schema: str, schema_lock: int, size: int) -> asyncpg.Pool:
    """A pool of at most ``size`` connections, ``schema`` run first under the advisory lock
    ``schema_lock`` (gateways starting at once create the tables once); :class:`StoreDown`
    naming ``what`` and the server when it cannot be reached, or refuses (no such database, no rights)."""
    pool = None
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S * 2):
            pool = await asyncpg.create_pool(
                dsn, min_size=1, max_size=size, timeout=CONNECT_TIMEOUT_S, command_timeout=None
            )
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", schema_lock)
                await conn.execute(schema)
    except (OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresError) as exc:
        if pool is not None:
            pool.terminate()
        raise StoreDown(
            f"{what} (postgresql at {where_of(dsn)}) cannot be opened: {type(exc).__name__}: {exc}"
        ) from None
    return pool


class PgStore:
    """A store on an asyncpg pool; ``what`` names it in messages ("the batch store"), ``down`` are
    the errors of a call that mean the store cannot be used now (:class:`StoreDown`)."""

    what: ClassVar[str]
    down: ClassVar[tuple[type[BaseException], ...]]

    def __init__(self, pool: asyncpg.Pool, where: str) -> None:
        self._pool = pool
        self.where = f"postgresql at {where}"

    async def close(self) -> None:
        await self._pool.close()

    async def _call(self, fn: Callable[[asyncpg.Connection], Awaitable[T]], timeout: float = CALL_TIMEOUT_S) -> T:
        """``fn`` on a pooled connection; the store unreachable (any refusal while connecting, an
        error of ``down``), or a call past ``timeout``, is :class:`StoreDown`; a value PostgreSQL
        cannot keep (a NUL character, say) that ``down`` does not count is the caller's error."""
        try:
            async with asyncio.timeout(timeout):
                try:
                    conn = await self._pool.acquire()
                except asyncpg.PostgresError as exc:  # refused while connecting: down, whatever the reason
                    raise StoreDown(self._message(exc)) from None
                try:
                    return await fn(conn)
                finally:
                    await self._pool.release(conn)
        except self.down as exc:
            raise StoreDown(self._message(exc)) from None
        except asyncpg.DataError as exc:
            raise InvalidRequest(f"a value sent cannot be kept: {type(exc).__name__}") from None

    def _message(self, exc: BaseException) -> str:
        return f"{self.what} ({self.where}) failed: {type(exc).__name__}: {exc}".rstrip(": ")
