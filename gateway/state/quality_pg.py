"""Live-traffic quality in PostgreSQL (asyncpg, no ORM), shared by a fleet of gateways.

The model is SQLite's (``gateway/state/quality_store.py``), in three tables of its own,
``quality_records``, ``quality_pairs`` and ``quality_feedback``, created when absent (once, whoever
starts first: an advisory lock). Every write is one statement, or one transaction for many
records, so gateways writing at once need no lease: a record or a pair written twice is kept
once (``ON CONFLICT DO NOTHING``), feedback given twice is the last written (an upsert guarded by
the record's owner, in the same statement), and a prune is one statement deleting a record with
its pair and feedback.

Text is kept without NUL characters, as in SQLite (see ``quality_store.clean``). Any failure,
the server unreachable or a call past its timeout, is :class:`StoreDown` naming the server
(host:port/database, never a password).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg

from gateway.state.batch_pg import where_of
from gateway.state.quality_store import (
    EXPORT_SELECT,
    PAIR_COLUMNS,
    RECORD_COLUMNS,
    Pair,
    Record,
    SliceCounts,
    counts_select,
    export_row,
    pair_row,
    record_row,
    slice_counts,
)
from gateway.state.stores import StoreDown

T = TypeVar("T")
CONNECT_TIMEOUT_S = 5.0  # a connection (at start: the gateway does not start past it)
CALL_TIMEOUT_S = 10.0  # one write, or the summary
BULK_TIMEOUT_S = 60.0  # an export, a prune
POOL_SIZE = 4

SCHEMA = """
CREATE TABLE IF NOT EXISTS quality_records (
    request_id text PRIMARY KEY, at double precision NOT NULL, owner text, model text NOT NULL,
    kind text NOT NULL, answered_by text NOT NULL, top boolean NOT NULL, slice text NOT NULL,
    cost double precision NOT NULL, prompt text);
CREATE INDEX IF NOT EXISTS quality_records_at ON quality_records (at);
CREATE TABLE IF NOT EXISTS quality_pairs (
    request_id text PRIMARY KEY, at double precision NOT NULL, kept text NOT NULL, top_answer text NOT NULL,
    agree boolean NOT NULL, cost double precision NOT NULL);
CREATE TABLE IF NOT EXISTS quality_feedback (
    request_id text PRIMARY KEY, at double precision NOT NULL, verdict text, score double precision);
"""
_SCHEMA_LOCK = 0x7175_616C  # pg_advisory_xact_lock ("qual"): gateways starting at once create the tables once
# a store that cannot answer (refused, closed, timed out) or refuses what it was asked
_FAILED = (OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresError)
_ORDER = ' ORDER BY r.model COLLATE "C", r.kind COLLATE "C", r.answered_by COLLATE "C", r.slice COLLATE "C", r.top'


def _values(n: int) -> str:
    return ", ".join(f"${i}" for i in range(1, n + 1))


class PgQuality:
    """The :class:`gateway.state.quality_store.QualityStore` in PostgreSQL; open it with :meth:`open`."""

    def __init__(self, pool: asyncpg.Pool, where: str) -> None:
        self._pool = pool
        self.where = f"postgresql at {where}"

    @classmethod
    async def open(cls, dsn: str) -> PgQuality:
        """Connect and create the tables; :class:`StoreDown` naming the server (host:port/database)
        when it cannot be reached."""
        where = where_of(dsn)
        pool = None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S * 2):
                pool = await asyncpg.create_pool(
                    dsn, min_size=1, max_size=POOL_SIZE, timeout=CONNECT_TIMEOUT_S, command_timeout=None
                )
                async with pool.acquire() as conn, conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
                    await conn.execute(SCHEMA)
        except _FAILED as exc:  # refused, timed out, no such database, no rights
            if pool is not None:
                pool.terminate()
            raise StoreDown(
                f"the quality store (postgresql at {where}) cannot be opened: {type(exc).__name__}: {exc}"
            ) from None
        return cls(pool, where)

    async def close(self) -> None:
        await self._pool.close()

    async def _call(self, fn: Callable[[asyncpg.Connection], Awaitable[T]], timeout: float = CALL_TIMEOUT_S) -> T:
        """``fn`` on a pooled connection; any failure, or a call past ``timeout``, is :class:`StoreDown`."""
        try:
            async with asyncio.timeout(timeout), self._pool.acquire() as conn:
                return await fn(conn)
        except _FAILED as exc:
            raise StoreDown(
                f"the quality store ({self.where}) failed: {type(exc).__name__}: {exc}".rstrip(": ")
            ) from None

    async def record(self, records: Sequence[Record]) -> None:
        if not records:
            return
        rows = [record_row(r) for r in records]

        async def go(c: asyncpg.Connection) -> None:
            async with c.transaction():
                await c.executemany(
                    f"INSERT INTO quality_records ({', '.join(RECORD_COLUMNS)}) VALUES ({_values(len(RECORD_COLUMNS))})"
                    " ON CONFLICT (request_id) DO NOTHING",
                    rows,
                )

        await self._call(go)

    async def pair(self, pair: Pair) -> None:
        await self._call(
            lambda c: c.execute(
                f"INSERT INTO quality_pairs ({', '.join(PAIR_COLUMNS)}) VALUES ({_values(len(PAIR_COLUMNS))})"
                " ON CONFLICT (request_id) DO NOTHING",
                *pair_row(pair),
            )
        )

    async def feedback(
        self, request_id: str, owner: str | None, at: float, verdict: str | None, score: float | None
    ) -> bool:
        if "\x00" in request_id or (owner is not None and "\x00" in owner):
            return False  # no record holds one (``quality_store.clean``)
        status = await self._call(
            lambda c: c.execute(
                "INSERT INTO quality_feedback (request_id, at, verdict, score)"
                " SELECT request_id, $3::float8, $4::text, $5::float8 FROM quality_records"
                " WHERE request_id = $1 AND ($2::text IS NULL OR owner = $2::text)"
                " ON CONFLICT (request_id) DO UPDATE SET at = excluded.at, verdict = excluded.verdict,"
                " score = excluded.score",
                request_id,
                owner,
                at,
                verdict,
                score,
            )
        )
        return status == "INSERT 0 1"

    async def counts(self, since: float) -> list[SliceCounts]:
        rows = await self._call(lambda c: c.fetch(counts_select("$1") + _ORDER, since))
        return [slice_counts(tuple(r)) for r in rows]

    async def export(self, since: float, limit: int) -> list[dict[str, Any]]:
        query = EXPORT_SELECT + ' AND r.at >= $1 ORDER BY r.at DESC, r.request_id COLLATE "C" DESC LIMIT $2'
        rows = await self._call(lambda c: c.fetch(query, since, limit), BULK_TIMEOUT_S)
        return [export_row(tuple(r)) for r in rows]

    async def prune(self, before: float) -> int:
        """One statement: the records older than ``before``, their pairs and feedback, and pairs and
        feedback older than it (a record never written)."""
        gone = await self._call(
            lambda c: c.fetchval(
                "WITH gone AS (DELETE FROM quality_records WHERE at < $1 RETURNING request_id),"
                " pairs AS (DELETE FROM quality_pairs WHERE at < $1 OR request_id IN (SELECT request_id FROM gone)),"
                " feedback AS (DELETE FROM quality_feedback"
                "   WHERE at < $1 OR request_id IN (SELECT request_id FROM gone))"
                " SELECT count(*) FROM gone",
                before,
            ),
            BULK_TIMEOUT_S,
        )
        return int(gone)
