"""Stored Responses in the fleet's PostgreSQL (``state.database``): a ``previous_response_id`` made
on one gateway (or worker) continues on any other that shares the database, with the same rules as
this process's store (``gateway/state/responses.py``): each response belongs to the key that made
it (another key gets the 404 a missing id gets; an operator key reads any), lives ``ttl_s``, and a
key's responses hold at most ``max_bytes_per_owner`` bytes, all keys' together ``max_bytes``, the
oldest dropped first.

Chosen over Redis where both are set (``state.store: redis`` and ``state.database``): PostgreSQL
keeps them on disk, and bounds them itself, where Redis bounds them only by its ``maxmemory``.

Two tables, made once whoever starts first: ``stored_responses`` (one row per response: its owner,
its size, its expiry on the database's clock, its turns and response as JSON bytes, and ``seq``,
its place in the order they were stored) and ``stored_response_owners`` (the bytes each owner
holds). Every write locks its owner's row first, then its responses, so two gateways storing for
one key at once keep its bound exactly and never deadlock: a put is one transaction (lock the
owner, insert, drop the owner's expired and over-bound oldest, count), and where all keys together
are over ``max_bytes``, or at most every ``SWEEP_S`` seconds, a sweep in a transaction of its own
drops the oldest and the expired of any key (one gateway at a time: an advisory lock).

A store that fails is :class:`StoreDown` (503 on a read; a put that fails is logged and the answer
still goes out, unstored), naming the server (host:port/database, never a password).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import asyncpg
import orjson
import structlog

from gateway.state.pg import PgStore, open_pool, where_of
from gateway.state.responses import Body, Stored, not_found
from gateway.state.stores import StoreDown

POOL_SIZE = 4
CALL_TIMEOUT_S = 2.0  # on the request's path: a read is one indexed row, a put a few statements
SWEEP_S = 60.0  # the expired of keys that store nothing new are dropped at least this often
SWEEP_ROWS = 1000  # a sweep's rows at most (a store far over its bound is brought under in a few puts)
NO_OWNER = "-"  # a gateway without keys: one owner for all
log = structlog.get_logger("triage.state")

SCHEMA = """
CREATE TABLE IF NOT EXISTS stored_responses (
    id text PRIMARY KEY, seq bigserial NOT NULL, owner text NOT NULL, size integer NOT NULL,
    expires timestamptz NOT NULL, body bytea NOT NULL);
CREATE INDEX IF NOT EXISTS stored_responses_owner ON stored_responses (owner, seq);
CREATE INDEX IF NOT EXISTS stored_responses_seq ON stored_responses (seq);
CREATE INDEX IF NOT EXISTS stored_responses_expires ON stored_responses (expires);
CREATE TABLE IF NOT EXISTS stored_response_owners (owner text PRIMARY KEY, bytes bigint NOT NULL);
"""
_SCHEMA_LOCK = 0x7265_7370  # pg_advisory_xact_lock ("resp"): gateways starting at once create the tables once
_SWEEP_LOCK = 0x7377_6570  # pg_try_advisory_xact_lock ("swep"): one sweep at a time across the fleet
_FAILED = (OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresError)

# $1 the owner: its row made or locked (every write locks its owner's row before its responses)
_LOCK_OWNER = (
    "INSERT INTO stored_response_owners (owner, bytes) VALUES ($1, 0)"
    " ON CONFLICT (owner) DO UPDATE SET bytes = stored_response_owners.bytes RETURNING bytes"
)
_INSERT = (
    "INSERT INTO stored_responses (id, owner, size, expires, body)"
    " VALUES ($1, $2, $3, clock_timestamp() + make_interval(secs => $4::float8), $5)"
    " ON CONFLICT (id) DO NOTHING"
)
# $1 the owner, $2 its bound: its expired rows, and its oldest while the newest-first sum is over
_TRIM_OWNER = """
WITH ranked AS (
    SELECT id, expires <= clock_timestamp() AS dead,
           sum(size) FILTER (WHERE expires > clock_timestamp()) OVER (ORDER BY seq DESC) AS kept
    FROM stored_responses WHERE owner = $1)
DELETE FROM stored_responses s USING ranked r
WHERE s.id = r.id AND (r.dead OR r.kept > $2) RETURNING s.size
"""
# $1 the owner, $2 what its bytes change by: the total of all owners, as it was before
_COUNT = (
    "UPDATE stored_response_owners SET bytes = bytes + $2 WHERE owner = $1"
    " RETURNING (SELECT coalesce(sum(bytes), 0) FROM stored_response_owners)"
)


class PgResponses(PgStore):
    """The :class:`gateway.state.responses.Responses` in PostgreSQL; open it with :meth:`open`."""

    what = "the response store"
    down = _FAILED

    def __init__(
        self,
        pool: asyncpg.Pool,
        where: str,
        ttl_s: float = 3600.0,
        max_bytes: int = 256 * 2**20,
        max_bytes_per_owner: int = 64 * 2**20,
    ) -> None:
        super().__init__(pool, where)
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_bytes_per_owner = max_bytes_per_owner
        self._swept = time.monotonic()

    @classmethod
    async def open(cls, dsn: str, **bounds: Any) -> PgResponses:
        """Connect and create the tables; :class:`StoreDown` naming the server when it cannot be reached."""
        return cls(await open_pool(dsn, cls.what, SCHEMA, _SCHEMA_LOCK, POOL_SIZE), where_of(dsn), **bounds)

    async def put(self, response: Body, messages: list[Body], owner: str | None = None) -> None:
        rid = str(response["id"])
        blob = orjson.dumps({"r": response, "m": messages})
        who = owner or NO_OWNER

        async def go(c: asyncpg.Connection) -> int:
            async with c.transaction():
                await c.fetchval(_LOCK_OWNER, who)
                added = await c.execute(_INSERT, rid, who, len(blob), self.ttl_s, blob)
                freed = sum(r[0] for r in await c.fetch(_TRIM_OWNER, who, self.max_bytes_per_owner))
                delta = (len(blob) if added == "INSERT 0 1" else 0) - freed
                total: int = await c.fetchval(_COUNT, who, delta)
                return total + delta

        total = await self._call(go, CALL_TIMEOUT_S)
        if total > self.max_bytes or time.monotonic() - self._swept > SWEEP_S:
            self._swept = time.monotonic()
            try:
                await self._call(self._sweep, CALL_TIMEOUT_S)
            except StoreDown as exc:  # stored; the next put sweeps again
                log.warning("response_sweep_failed", error=exc.message)

    async def get(self, response_id: str, owner: str | None = None, operator: bool = False) -> Stored:
        if "\x00" in response_id:
            raise not_found(response_id)  # PostgreSQL's text holds none: no response has one
        row = await self._call(
            lambda c: c.fetchrow(
                "SELECT owner, body FROM stored_responses WHERE id = $1 AND expires > clock_timestamp()", response_id
            ),
            CALL_TIMEOUT_S,
        )
        if row is None:
            raise not_found(response_id)
        found = None if row["owner"] == NO_OWNER else row["owner"]
        if not (operator or found is None or found == owner):
            raise not_found(response_id)
        item = orjson.loads(row["body"])
        return Stored(item["r"], item["m"], expires=0.0, owner=found, size=len(row["body"]))

    async def delete(self, response_id: str, owner: str | None = None, operator: bool = False) -> None:
        found = await self.get(response_id, owner, operator)
        who = found.owner or NO_OWNER

        async def go(c: asyncpg.Connection) -> bool:
            async with c.transaction():
                await c.fetchval(_LOCK_OWNER, who)
                size = await c.fetchval(
                    "DELETE FROM stored_responses WHERE id = $1 AND owner = $2 RETURNING size", response_id, who
                )
                if size is None:
                    return False
                await c.execute("UPDATE stored_response_owners SET bytes = bytes - $2 WHERE owner = $1", who, size)
                return True

        if not await self._call(go, CALL_TIMEOUT_S):
            raise not_found(response_id)  # gone meanwhile (another gateway's delete, its expiry, a bound)

    async def _sweep(self, c: asyncpg.Connection) -> None:
        """The expired of every key, and the oldest while all keys together hold over ``max_bytes``:
        their owners' rows locked first, in order (as every write does), then the rows dropped."""
        async with c.transaction():
            if not await c.fetchval("SELECT pg_try_advisory_xact_lock($1)", _SWEEP_LOCK):
                return  # another gateway sweeps now
            total = await c.fetchval("SELECT coalesce(sum(bytes), 0) FROM stored_response_owners")
            rows = await c.fetch(
                "SELECT id, owner, size, expires <= clock_timestamp() AS dead FROM stored_responses"
                " ORDER BY seq LIMIT $1",
                SWEEP_ROWS,
            )
            excess, gone = total - self.max_bytes, []
            for r in rows:
                if r["dead"] or excess > 0:
                    gone.append(r["id"])
                    excess -= r["size"]
            if not gone:
                return
            owners = sorted({r["owner"] for r in rows if r["id"] in set(gone)})
            await c.fetch(
                "SELECT owner FROM stored_response_owners WHERE owner = ANY($1::text[]) ORDER BY owner FOR UPDATE",
                owners,
            )
            freed: defaultdict[str, int] = defaultdict(int)
            for r in await c.fetch(
                "DELETE FROM stored_responses WHERE id = ANY($1::text[]) RETURNING owner, size", gone
            ):
                freed[r["owner"]] += r["size"]
            await c.execute(
                "UPDATE stored_response_owners o SET bytes = o.bytes - d.freed"
                " FROM unnest($1::text[], $2::bigint[]) AS d(owner, freed) WHERE o.owner = d.owner",
                list(freed),
                list(freed.values()),
            )
            await c.execute("DELETE FROM stored_response_owners WHERE bytes <= 0")
