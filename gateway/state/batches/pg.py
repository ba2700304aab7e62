"""Files' metadata and batch jobs in PostgreSQL (asyncpg, no ORM), shared by a fleet of gateways.

The model is SQLite's (``sqlite.py``), made safe for many runners at once:

- a runner claims a prefix group with ``SELECT ... FOR UPDATE SKIP LOCKED`` (two runners never
  wait on, or take, the same group) and holds it under a lease: its owner id and an expiry on the
  database's clock (gateways' clocks may differ), renewed while it works. A group whose lease ran
  out (its gateway was killed, or cut off) is claimed again by any runner;
- a result is written by one ``UPDATE`` that also marks its request done, only while the request
  is pending and its batch running: a late writer whose lease was taken finds it done and writes
  nothing, so every ``custom_id`` appears once in the output;
- a batch's transitions (validated, finalizing, ended, cancelling) are single guarded statements
  or transactions, conditioned on its status and on who holds its lease: one runner validates a
  batch, one finalizes it, and a cancel from any gateway lands once.

Files' bytes are not here: they stay on the ``batches.dir`` folder the fleet shares.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import asyncpg

from gateway.state.batches import model
from gateway.state.pg import PgStore, insert, open_pool, where_of

BULK_TIMEOUT_S = 300.0  # a batch's requests written at validation, its results read at finalization
POOL_SIZE = 8

SCHEMA = """
CREATE TABLE IF NOT EXISTS triage_files (
    id text PRIMARY KEY, purpose text NOT NULL, filename text NOT NULL, bytes bigint NOT NULL,
    created_at bigint NOT NULL, owner text, expires_at bigint);
CREATE INDEX IF NOT EXISTS triage_files_expiry ON triage_files (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS triage_batches (
    id text PRIMARY KEY, doc jsonb NOT NULL, status text NOT NULL, created_at bigint NOT NULL, owner text,
    lease_owner text, lease_until timestamptz);
CREATE INDEX IF NOT EXISTS triage_batches_created ON triage_batches (created_at, id);
CREATE TABLE IF NOT EXISTS triage_batch_groups (
    batch_id text NOT NULL, grp integer NOT NULL, state text NOT NULL DEFAULT 'open',
    lease_owner text, lease_until timestamptz, claims integer NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, grp));
CREATE INDEX IF NOT EXISTS triage_batch_groups_open ON triage_batch_groups (batch_id, grp) WHERE state = 'open';
CREATE TABLE IF NOT EXISTS triage_batch_requests (
    batch_id text NOT NULL, line integer NOT NULL, custom_id text, body text, state text NOT NULL, result text,
    grp integer, seq integer NOT NULL, affinity text, PRIMARY KEY (batch_id, line));
CREATE INDEX IF NOT EXISTS triage_batch_requests_state ON triage_batch_requests (batch_id, state);
CREATE INDEX IF NOT EXISTS triage_batch_requests_group ON triage_batch_requests (batch_id, grp, state);
"""
_SCHEMA_LOCK = 0x7472_6961  # pg_advisory_xact_lock: gateways starting at once create the tables once
# the errors that mean "the store cannot be used now", in a call (any error while connecting does)
_DOWN = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.TransactionRollbackError,
)


def _lease(n: int) -> str:
    """A lease's expiry, on the database's clock: now plus parameter ``$n`` seconds."""
    return f"clock_timestamp() + make_interval(secs => ${n}::float8)"


def _mine(n: int) -> str:
    """The viewer's rows (parameter ``$n``); a viewer of None sees all."""
    return f"(${n}::text IS NULL OR owner = ${n}::text)"


class PgBatches(PgStore, model.FileFolder):
    """The :class:`gateway.state.batches.Batches` store in PostgreSQL; open it with :meth:`open`."""

    what = "the batch store"
    down = _DOWN

    def __init__(self, pool: asyncpg.Pool, root: Path, where: str) -> None:
        super().__init__(pool, where)
        self.root = root

    @classmethod
    async def open(cls, dsn: str, root: Path) -> PgBatches:
        """Connect and create the tables (once, whoever starts first); :class:`StoreDown` naming
        the server (host:port/database) when it cannot be reached."""
        await asyncio.to_thread((root / "files").mkdir, parents=True, exist_ok=True)
        pool = await open_pool(dsn, cls.what, SCHEMA, _SCHEMA_LOCK, POOL_SIZE)
        return cls(pool, root, where_of(dsn))

    # --- files ------------------------------------------------------------------------------------------------

    async def add_file(
        self, content: bytes, filename: str, purpose: str, owner: str | None = None, expires_after: int | None = None
    ) -> dict[str, Any]:
        new = await asyncio.to_thread(self.write_file, content, filename, purpose, owner, expires_after)
        query = insert("triage_files", model.FILE_COLUMNS)
        try:
            await self._call(lambda c: c.execute(query, *new))
        except BaseException:
            await asyncio.to_thread(self.file_path(new.id).unlink, missing_ok=True)  # no bytes without their row
            raise
        return new.doc()

    async def file(self, file_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        row = await self._call(
            lambda c: c.fetchrow(
                "SELECT id, purpose, filename, bytes, created_at, expires_at FROM triage_files WHERE id = $1 AND "
                + _mine(2)
                + " AND (expires_at IS NULL OR expires_at > $3)",
                file_id,
                viewer,
                int(time.time()),
            )
        )
        return None if row is None else model.file_doc(tuple(row))

    async def delete_file(self, file_id: str, viewer: str | None = None) -> bool:
        query = "DELETE FROM triage_files WHERE id = $1 AND " + _mine(2) + " RETURNING id"
        gone = await self._call(lambda c: c.fetchval(query, file_id, viewer))
        if gone is not None:
            await asyncio.to_thread(self.file_path(file_id).unlink, missing_ok=True)
        return gone is not None

    async def sweep(self) -> list[str]:
        """Every file past its ``expires_at`` removed: each by one gateway (its DELETE returns it)."""
        rows = await self._call(
            lambda c: c.fetch("DELETE FROM triage_files WHERE expires_at <= $1 RETURNING id", int(time.time()))
        )
        ids = [r["id"] for r in rows]
        for file_id in ids:
            await asyncio.to_thread(self.file_path(file_id).unlink, missing_ok=True)
        return ids

    # --- batches ----------------------------------------------------------------------------------------------

    async def add_batch(self, doc: dict[str, Any], owner: str | None = None) -> None:
        await self._call(
            lambda c: c.execute(
                "INSERT INTO triage_batches (id, doc, status, created_at, owner) VALUES ($1, $2::jsonb, $3, $4, $5)",
                doc["id"],
                json.dumps(doc),
                doc["status"],
                doc["created_at"],
                owner,
            )
        )

    async def batch(self, batch_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        query = "SELECT doc::text FROM triage_batches WHERE id = $1 AND " + _mine(2)
        raw = await self._call(lambda c: c.fetchval(query, batch_id, viewer))
        return json.loads(raw) if raw is not None else None

    async def batches(self, limit: int, after: str | None, viewer: str | None = None) -> list[dict[str, Any]]:
        """Newest first; ``after`` is the id of the last batch of the previous page."""
        query = (
            "SELECT doc::text FROM triage_batches WHERE " + _mine(1) + " AND ($3::text IS NULL OR (created_at, id) <"
            " (SELECT created_at, id FROM triage_batches WHERE id = $3)) ORDER BY created_at DESC, id DESC LIMIT $2"
        )
        rows = await self._call(lambda c: c.fetch(query, viewer, limit, after))
        return [json.loads(r[0]) for r in rows]

    async def cancel(self, batch_id: str, viewer: str | None, now: int) -> dict[str, Any] | None:
        """A validating or running batch becomes ``cancelling`` (one statement: a cancel and a
        finalizer never both win); its doc after, or None when ``viewer`` has no such batch."""
        patch = json.dumps({"status": "cancelling", "cancelling_at": now})
        update = (
            "UPDATE triage_batches SET status = 'cancelling', doc = doc || $3::jsonb WHERE id = $1 AND "
            + _mine(2)
            + " AND status IN ('validating', 'in_progress') RETURNING doc::text"
        )
        read = "SELECT doc::text FROM triage_batches WHERE id = $1 AND " + _mine(2)

        async def go(c: asyncpg.Connection) -> str | None:
            raw = await c.fetchval(update, batch_id, viewer, patch)
            return raw if raw is not None else await c.fetchval(read, batch_id, viewer)

        raw = await self._call(go)
        return json.loads(raw) if raw is not None else None

    async def counts(self, batch_id: str) -> dict[str, int]:
        rows = await self._call(
            lambda c: c.fetch(
                "SELECT state, count(*) FROM triage_batch_requests WHERE batch_id = $1 GROUP BY state", batch_id
            )
        )
        return model.counts_of({r[0]: r[1] for r in rows})

    async def results(self, batch_id: str, state: str) -> list[str]:
        rows = await self._call(
            lambda c: c.fetch(
                "SELECT result FROM triage_batch_requests WHERE batch_id = $1 AND state = $2 ORDER BY line",
                batch_id,
                state,
            ),
            BULK_TIMEOUT_S,
        )
        return [r[0] for r in rows]

    # --- the runner: batches' leases and transitions -------------------------------------------------------------

    async def work(self) -> list[tuple[str, str]]:
        rows = await self._call(
            lambda c: c.fetch(
                "SELECT id, status FROM triage_batches WHERE status = ANY($1::text[]) ORDER BY created_at, id",
                list(model.ACTIVE),
            )
        )
        return [(r[0], r[1]) for r in rows]

    async def claim_validation(self, batch_id: str, owner: str, lease_s: float) -> model.BatchClaim | None:
        row = await self._call(
            lambda c: c.fetchrow(
                "UPDATE triage_batches SET lease_owner = $2, lease_until = " + _lease(3) + " WHERE id = $1"
                " AND status = 'validating' AND (lease_until IS NULL OR lease_until < clock_timestamp())"
                " RETURNING doc::text, owner",
                batch_id,
                owner,
                lease_s,
            )
        )
        return model.BatchClaim(json.loads(row[0]), row[1]) if row else None

    async def claim_finalization(
        self, batch_id: str, owner: str, lease_s: float, stamp: int
    ) -> model.BatchClaim | None:
        """One statement: the batch becomes ``finalizing`` under this owner's lease when it is ready
        (see ``BatchStore.claim_finalization``); two runners at once: the row lock lets one in, and
        the other finds the status changed."""
        row = await self._call(
            lambda c: c.fetchrow(
                "UPDATE triage_batches b SET status = 'finalizing', lease_owner = $2, lease_until = " + _lease(3) + ","
                " doc = b.doc || jsonb_build_object('status', 'finalizing', 'finalizing_at',"
                "   coalesce(nullif(b.doc->'finalizing_at', 'null'::jsonb), to_jsonb($4::bigint)))"
                " WHERE b.id = $1 AND ("
                " (b.status = 'in_progress' AND NOT EXISTS (SELECT 1 FROM triage_batch_requests r"
                "   WHERE r.batch_id = b.id AND r.state = 'pending'))"
                " OR (b.status = 'cancelling' AND NOT EXISTS (SELECT 1 FROM triage_batch_groups g"
                "   WHERE g.batch_id = b.id AND g.lease_owner IS NOT NULL AND g.lease_until >= clock_timestamp()))"
                " OR (b.status = 'finalizing' AND (b.lease_until IS NULL OR b.lease_until < clock_timestamp())))"
                " RETURNING b.doc::text, b.owner",
                batch_id,
                owner,
                lease_s,
                stamp,
            )
        )
        return model.BatchClaim(json.loads(row[0]), row[1]) if row else None

    async def renew_batch(self, batch_id: str, owner: str, lease_s: float) -> bool:
        status = await self._call(
            lambda c: c.execute(
                "UPDATE triage_batches SET lease_until = " + _lease(3) + " WHERE id = $1 AND lease_owner = $2"
                " AND status IN ('validating', 'finalizing')",
                batch_id,
                owner,
                lease_s,
            )
        )
        return status == "UPDATE 1"

    async def start_batch(
        self, batch_id: str, owner: str, rows: list[model.Row], groups: int, fields: dict[str, Any]
    ) -> bool:
        """A validated batch's requests, groups and new state in one transaction (the batch's row
        locked first); False, nothing written, unless it is still validating under this owner's lease."""

        async def go(c: asyncpg.Connection) -> bool:
            async with c.transaction():
                if not await _hold(c, batch_id, owner, ["validating"]):
                    return False
                await c.copy_records_to_table(
                    "triage_batch_requests",
                    columns=list(model.REQUEST_COLUMNS),
                    records=[model.request_record(batch_id, r) for r in rows],
                )
                await c.copy_records_to_table(
                    "triage_batch_groups", columns=["batch_id", "grp"], records=[(batch_id, g) for g in range(groups)]
                )
                await _set_state(c, batch_id, fields)
                return True

        return await self._call(go, BULK_TIMEOUT_S)

    async def end_batch(self, batch_id: str, owner: str, fields: dict[str, Any], files: list[model.FileRow]) -> bool:
        """The batch's last state and its output files' rows in one transaction; False, nothing
        written, unless this owner holds its lease (validating or finalizing)."""
        now = int(time.time())

        async def go(c: asyncpg.Connection) -> bool:
            async with c.transaction():
                if not await _hold(c, batch_id, owner, ["validating", "finalizing"]):
                    return False
                await c.executemany(
                    "INSERT INTO triage_files (id, purpose, filename, bytes, created_at, owner)"
                    " VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (id) DO NOTHING",
                    [(f.id, f.purpose, f.filename, f.bytes, now, f.owner) for f in files],
                )
                await _set_state(c, batch_id, fields)
                return True

        return await self._call(go)

    # --- the runner: groups and requests --------------------------------------------------------------------------

    async def claim_group(self, owner: str, lease_s: float) -> model.GroupClaim | None:
        """The first open group of the oldest running batch that no live lease holds. Its row is
        locked with SKIP LOCKED (a group another runner is claiming right now is passed over), its
        batch's row shared (a cancel or a finalizer waits for this claim, and sees its lease)."""
        claim = (
            "WITH pick AS (SELECT g.batch_id, g.grp FROM triage_batch_groups g"
            " JOIN triage_batches b ON b.id = g.batch_id"
            " WHERE g.state = 'open' AND b.status = 'in_progress'"
            "   AND (g.lease_until IS NULL OR g.lease_until < clock_timestamp())"
            " ORDER BY b.created_at, b.id, g.grp LIMIT 1 FOR UPDATE OF g SKIP LOCKED FOR SHARE OF b)"
            " UPDATE triage_batch_groups g SET lease_owner = $1, lease_until = " + _lease(2) + ", claims = g.claims + 1"
            " FROM pick WHERE g.batch_id = pick.batch_id AND g.grp = pick.grp"
            " RETURNING g.batch_id, g.grp, g.claims,"
            " (SELECT doc->>'endpoint' FROM triage_batches WHERE id = g.batch_id),"
            " (SELECT owner FROM triage_batches WHERE id = g.batch_id)"
        )

        async def go(c: asyncpg.Connection) -> model.GroupClaim | None:
            async with c.transaction():
                row = await c.fetchrow(claim, owner, lease_s)
                if row is None:
                    return None
                batch_id, grp, claims, endpoint, batch_owner = row
                pending = await c.fetch(
                    "SELECT line, custom_id, body, affinity FROM triage_batch_requests"
                    " WHERE batch_id = $1 AND grp = $2 AND state = 'pending' ORDER BY seq",
                    batch_id,
                    grp,
                )
            return model.GroupClaim(
                batch_id,
                grp,
                endpoint,
                claims,
                [model.Pending(r[0], r[1], json.loads(r[2]), r[3]) for r in pending],
                batch_owner,
            )

        return await self._call(go)

    async def renew_groups(self, owner: str, keys: list[tuple[str, int]], lease_s: float) -> dict[tuple[str, int], str]:
        """Extend this owner's leases on ``keys``; those it still holds, with their batch's status."""
        rows = await self._call(
            lambda c: c.fetch(
                "UPDATE triage_batch_groups g SET lease_until = " + _lease(4) + " FROM triage_batches b"
                " WHERE b.id = g.batch_id AND g.lease_owner = $1 AND g.state = 'open'"
                " AND (g.batch_id, g.grp) IN (SELECT * FROM unnest($2::text[], $3::int[]))"
                " RETURNING g.batch_id, g.grp, b.status",
                owner,
                [k[0] for k in keys],
                [k[1] for k in keys],
                lease_s,
            )
        )
        return {(r[0], r[1]): r[2] for r in rows}

    async def release_group(self, batch_id: str, grp: int, owner: str) -> None:
        await self._call(
            lambda c: c.execute(
                "UPDATE triage_batch_groups SET lease_owner = NULL, lease_until = NULL, state = CASE WHEN EXISTS"
                " (SELECT 1 FROM triage_batch_requests r WHERE r.batch_id = $1 AND r.grp = $2 AND r.state = 'pending')"
                " THEN 'open' ELSE 'done' END WHERE batch_id = $1 AND grp = $2 AND lease_owner = $3",
                batch_id,
                grp,
                owner,
            )
        )

    async def finish_request(self, batch_id: str, line: int, ok: bool, result: dict[str, Any]) -> bool:
        """One statement: the result, and the request done, only if it is still pending (a second
        writer waits on the row's lock, then finds it done) and its batch still running."""
        status = await self._call(
            lambda c: c.execute(
                "UPDATE triage_batch_requests SET state = $3, result = $4 WHERE batch_id = $1 AND line = $2"
                " AND state = 'pending' AND EXISTS (SELECT 1 FROM triage_batches WHERE id = $1"
                " AND status IN ('in_progress', 'cancelling') FOR SHARE)",
                batch_id,
                line,
                "done" if ok else "error",
                json.dumps(result),
            )
        )
        return status == "UPDATE 1"


async def _hold(c: asyncpg.Connection, batch_id: str, owner: str, statuses: list[str]) -> bool:
    """Lock the batch's row for this transaction if it is in one of ``statuses`` under ``owner``'s lease."""
    return bool(
        await c.fetchval(
            "SELECT 1 FROM triage_batches WHERE id = $1 AND status = ANY($3::text[]) AND lease_owner = $2 FOR UPDATE",
            batch_id,
            owner,
            statuses,
        )
    )


async def _set_state(c: asyncpg.Connection, batch_id: str, fields: dict[str, Any]) -> None:
    """The batch's new status and fields merged into its document; its lease given up."""
    await c.execute(
        "UPDATE triage_batches SET status = $2, doc = doc || $3::jsonb, lease_owner = NULL, lease_until = NULL"
        " WHERE id = $1",
        batch_id,
        fields["status"],
        json.dumps(fields),
    )
