"""Live-traffic quality in PostgreSQL (asyncpg, no ORM), shared by a fleet of gateways.

The model is SQLite's (``model.py``), in three tables of its own,
``quality_records``, ``quality_pairs`` and ``quality_feedback``, created when absent (once, whoever
starts first: an advisory lock). Every write is one statement, or one transaction for many
records, so gateways writing at once need no lease: a record or a pair written twice is kept
once (``ON CONFLICT DO NOTHING``), feedback given twice is the last written (an upsert guarded by
the record's owner, in the same statement), and a prune is one statement deleting a record with
its pair and feedback.

Text is kept without NUL characters, as in SQLite (see ``model.clean``). Any failure,
the server unreachable or a call past its timeout, is :class:`StoreDown` naming the server
(host:port/database, never a password).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg

from gateway.state.pg import PgStore, insert, open_pool, where_of
from gateway.state.quality import model

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


class PgQuality(PgStore):
    """The :class:`gateway.state.quality.QualityStore` in PostgreSQL; open it with :meth:`open`."""

    what = "the quality store"
    down = _FAILED

    @classmethod
    async def open(cls, dsn: str) -> PgQuality:
        """Connect and create the tables; :class:`StoreDown` naming the server (host:port/database)
        when it cannot be reached."""
        return cls(await open_pool(dsn, cls.what, SCHEMA, _SCHEMA_LOCK, POOL_SIZE), where_of(dsn))

    async def record(self, records: Sequence[model.Record]) -> None:
        if not records:
            return
        rows = [model.record_row(r) for r in records]

        async def go(c: asyncpg.Connection) -> None:
            async with c.transaction():
                await c.executemany(
                    insert("quality_records", model.RECORD_COLUMNS) + " ON CONFLICT (request_id) DO NOTHING",
                    rows,
                )

        await self._call(go)

    async def pair(self, pair: model.Pair) -> None:
        await self._call(
            lambda c: c.execute(
                insert("quality_pairs", model.PAIR_COLUMNS) + " ON CONFLICT (request_id) DO NOTHING",
                *model.pair_row(pair),
            )
        )

    async def feedback(
        self, request_id: str, owner: str | None, at: float, verdict: str | None, score: float | None
    ) -> bool:
        if "\x00" in request_id or (owner is not None and "\x00" in owner):
            return False  # no record holds one (``model.clean``)
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

    async def counts(self, since: float) -> list[model.SliceCounts]:
        rows = await self._call(lambda c: c.fetch(model.counts_select("$1") + _ORDER, since))
        return [model.slice_counts(tuple(r)) for r in rows]

    async def export(self, since: float, limit: int) -> list[dict[str, Any]]:
        query = model.EXPORT_SELECT + ' AND r.at >= $1 ORDER BY r.at DESC, r.request_id COLLATE "C" DESC LIMIT $2'
        rows = await self._call(lambda c: c.fetch(query, since, limit), BULK_TIMEOUT_S)
        return [model.export_row(tuple(r)) for r in rows]

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
