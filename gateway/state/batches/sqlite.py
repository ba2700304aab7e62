"""Files and batch jobs of the Batch API in SQLite and on disk (the embedded default): a restart
loses nothing, and one gateway process holds the store (a file lock).

The job model is the fleet's (``pg.py`` keeps it in PostgreSQL for several gateways): a
validated batch's requests are cut into prefix groups, each a row that a runner claims with a
lease (owner and expiry) before it runs the group's requests. Every request is a row; its result
is written in the same transaction that marks it done, and only while it is still pending, so a
finished request is never run into the output twice. State transitions of a batch are guarded by
its status and by who holds its lease. One process holds this store, so the leases here only ever
have one owner alive: those of a killed process are cleared when the next one opens the store.

The interface is async (``contract.Batches``, the one PostgreSQL's store has too); the bodies are
sqlite3's, synchronous, each run on a worker thread (``gateway/state/sqlite.py``, which also turns
sqlite3's failures into ``StoreDown``). One connection, guarded by a lock: each method is atomic.

Files and batches belong to the key that made them (``owner``: the key's sha256, None when the
gateway runs without keys). A ``viewer`` of None sees everything (no keys, or the runner itself);
any other viewer sees only what it owns, and anything else reads as absent.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from gateway.state.batches import model
from gateway.state.sqlite import SqliteStore, connect, insert, marks, threaded

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, owner TEXT, expires_at INTEGER);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, doc TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL, owner TEXT,
    lease_owner TEXT, lease_until REAL);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, body TEXT, state TEXT NOT NULL,
    result TEXT, grp INTEGER, seq INTEGER, affinity TEXT, PRIMARY KEY (batch_id, line));
CREATE TABLE IF NOT EXISTS groups (
    batch_id TEXT NOT NULL, grp INTEGER NOT NULL, state TEXT NOT NULL DEFAULT 'open',
    lease_owner TEXT, lease_until REAL, claims INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, grp));
CREATE INDEX IF NOT EXISTS requests_pending ON requests (batch_id, state);
"""
_A = ",".join(f"'{s}'" for s in model.ACTIVE)

_MINE = " AND (? IS NULL OR owner = ?)"  # the viewer's rows; a viewer of None sees all
_LIVE = " AND (expires_at IS NULL OR expires_at > ?)"  # an expired file is gone, swept or not yet
_COLUMNS = {  # added to a store made by an older triage: its rows have none
    ("files", "owner"): "TEXT",
    ("batches", "owner"): "TEXT",
    ("files", "expires_at"): "INTEGER",
    ("batches", "lease_owner"): "TEXT",
    ("batches", "lease_until"): "REAL",
    ("requests", "grp"): "INTEGER",
    ("requests", "seq"): "INTEGER",
    ("requests", "affinity"): "TEXT",
}


class StoreBusy(RuntimeError):
    """Another gateway process holds this store: two runners must never work one SQLite store."""


class BatchStore(SqliteStore, model.FileFolder):
    """The :class:`gateway.state.batches.Batches` store in SQLite (see the module's docstring); open it
    with :meth:`open` (the constructor blocks: it takes the lock and migrates the schema)."""

    what = "the batch store"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = f"sqlite at {root / 'batches.sqlite3'}"
        (root / "files").mkdir(parents=True, exist_ok=True)
        self._lockfile = open(root / "lock", "w")  # noqa: SIM115 - held for the store's lifetime
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lockfile.close()
            raise StoreBusy(f"{root} is in use by another gateway process") from None
        self._attach(connect(root / "batches.sqlite3", timeout=5.0))
        self._db.executescript(SCHEMA)
        for (table, column), kind in _COLUMNS.items():
            if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self._db.executescript("""
CREATE INDEX IF NOT EXISTS requests_group ON requests (batch_id, grp, state);
-- requests of a batch an older triage was running: one group, so they run
INSERT OR IGNORE INTO groups (batch_id, grp)
    SELECT DISTINCT batch_id, -1 FROM requests WHERE grp IS NULL AND state = 'pending';
UPDATE requests SET grp = -1, seq = line WHERE grp IS NULL AND state = 'pending';
-- this process holds the store: every lease is a dead process's
UPDATE groups SET lease_owner = NULL, lease_until = NULL WHERE lease_owner IS NOT NULL;
UPDATE batches SET lease_owner = NULL, lease_until = NULL WHERE lease_owner IS NOT NULL;
""")

    @classmethod
    async def open(cls, root: Path) -> BatchStore:
        """The store on ``root``, opened on a worker thread; :class:`StoreBusy` when another process holds it."""
        return await asyncio.to_thread(cls, root)

    @threaded
    def close(self) -> None:
        self._close()
        self._lockfile.close()  # releases the flock

    def _merge(self, batch_id: str, fields: dict[str, Any]) -> dict[str, Any]:
        """The batch's doc with ``fields`` written over it (its ``status`` column follows); in a transaction."""
        (raw,) = self._db.execute("SELECT doc FROM batches WHERE id = ?", (batch_id,)).fetchone()
        doc = json.loads(raw) | fields
        self._db.execute(
            "UPDATE batches SET doc = ?, status = ? WHERE id = ?", (json.dumps(doc), doc["status"], batch_id)
        )
        return doc

    # --- files ------------------------------------------------------------------------------------------------

    @threaded
    def add_file(
        self, content: bytes, filename: str, purpose: str, owner: str | None = None, expires_after: int | None = None
    ) -> dict[str, Any]:
        """A new file; ``expires_after``: seconds from now after which it is gone (None: never)."""
        new = self.write_file(content, filename, purpose, owner, expires_after)
        with self._lock:
            self._db.execute(insert("files", model.FILE_COLUMNS), new)
        return new.doc()

    @threaded
    def file(self, file_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, purpose, filename, bytes, created_at, expires_at FROM files WHERE id = ?" + _MINE + _LIVE,
                (file_id, viewer, viewer, int(time.time())),
            ).fetchone()
        return None if row is None else model.file_doc(row)

    @threaded
    def delete_file(self, file_id: str, viewer: str | None = None) -> bool:
        """Remove the file (row, then bytes); False when ``viewer`` has no such file."""
        with self._lock:
            cur = self._db.execute("DELETE FROM files WHERE id = ?" + _MINE, (file_id, viewer, viewer))
        if cur.rowcount == 1:
            self.file_path(file_id).unlink(missing_ok=True)
        return cur.rowcount == 1

    @threaded
    def sweep(self, now: float | None = None) -> list[str]:
        """Remove every file past its ``expires_at``; the ids removed."""
        stamp = int(time.time() if now is None else now)
        with self._lock:
            ids = [r[0] for r in self._db.execute("DELETE FROM files WHERE expires_at <= ? RETURNING id", (stamp,))]
        for file_id in ids:
            self.file_path(file_id).unlink(missing_ok=True)
        return ids

    # --- batches ----------------------------------------------------------------------------------------------

    @threaded
    def add_batch(self, doc: dict[str, Any], owner: str | None = None) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO batches (id, doc, status, created_at, owner) VALUES (?, ?, ?, ?, ?)",
                (doc["id"], json.dumps(doc), doc["status"], doc["created_at"], owner),
            )

    @threaded
    def batch(self, batch_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT doc FROM batches WHERE id = ?" + _MINE, (batch_id, viewer, viewer)
            ).fetchone()
        return json.loads(row[0]) if row else None

    @threaded
    def batches(self, limit: int, after: str | None, viewer: str | None = None) -> list[dict[str, Any]]:
        """Newest first; ``after`` is the id of the last batch of the previous page."""
        with self._lock:
            if after is None:
                rows = self._db.execute(
                    "SELECT doc FROM batches WHERE 1" + _MINE + " ORDER BY created_at DESC, id DESC LIMIT ?",
                    (viewer, viewer, limit),
                ).fetchall()
            else:
                rows = self._db.execute(
                    "SELECT doc FROM batches WHERE (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ?)"
                    + _MINE
                    + " ORDER BY created_at DESC, id DESC LIMIT ?",
                    (after, viewer, viewer, limit),
                ).fetchall()
        return [json.loads(r[0]) for r in rows]

    @threaded
    def cancel(self, batch_id: str, viewer: str | None, now: int) -> dict[str, Any] | None:
        """A validating or running batch becomes ``cancelling``; any other is left as it is. Its doc
        after, or None when ``viewer`` has no such batch."""
        with self._tx() as db:
            row = db.execute(
                "SELECT doc, status FROM batches WHERE id = ?" + _MINE, (batch_id, viewer, viewer)
            ).fetchone()
            if row is None or row[1] not in ("validating", "in_progress"):
                return json.loads(row[0]) if row else None
            return self._merge(batch_id, {"status": "cancelling", "cancelling_at": now})

    @threaded
    def counts(self, batch_id: str) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT state, COUNT(*) FROM requests WHERE batch_id = ? GROUP BY state", (batch_id,)
            ).fetchall()
        return model.counts_of(dict(rows))

    @threaded
    def results(self, batch_id: str, state: str) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT result FROM requests WHERE batch_id = ? AND state = ? ORDER BY line", (batch_id, state)
            ).fetchall()
        return [r[0] for r in rows]

    # --- the runner: batches' leases and transitions -------------------------------------------------------------

    @threaded
    def work(self) -> list[tuple[str, str]]:
        """(id, status) of every batch not yet ended, oldest first."""
        with self._lock:
            return self._db.execute(
                f"SELECT id, status FROM batches WHERE status IN ({_A}) ORDER BY created_at, id"
            ).fetchall()

    @threaded
    def claim_validation(self, batch_id: str, owner: str, lease_s: float) -> model.BatchClaim | None:
        now = time.time()
        with self._lock:
            row = self._db.execute(
                "UPDATE batches SET lease_owner = ?, lease_until = ? WHERE id = ? AND status = 'validating'"
                " AND (lease_until IS NULL OR lease_until < ?) RETURNING doc, owner",
                (owner, now + lease_s, batch_id, now),
            ).fetchone()
        return model.BatchClaim(json.loads(row[0]), row[1]) if row else None

    @threaded
    def claim_finalization(self, batch_id: str, owner: str, lease_s: float, stamp: int) -> model.BatchClaim | None:
        """The batch, now ``finalizing`` under this owner's lease, when it is ready: running with no
        request pending; cancelling with no group held (what was in flight has ended); or
        finalizing under a lease that ran out (its finalizer stopped)."""
        now = time.time()
        with self._tx() as db:
            row = db.execute(
                "SELECT owner, doc FROM batches b WHERE id = ? AND ("
                " (status = 'in_progress' AND NOT EXISTS"
                "   (SELECT 1 FROM requests r WHERE r.batch_id = b.id AND r.state = 'pending'))"
                " OR (status = 'cancelling' AND NOT EXISTS (SELECT 1 FROM groups g WHERE g.batch_id = b.id"
                "   AND g.lease_owner IS NOT NULL AND g.lease_until >= ?))"
                " OR (status = 'finalizing' AND (lease_until IS NULL OR lease_until < ?)))",
                (batch_id, now, now),
            ).fetchone()
            if row is None:
                return None
            db.execute(
                "UPDATE batches SET lease_owner = ?, lease_until = ? WHERE id = ?", (owner, now + lease_s, batch_id)
            )
            since = json.loads(row[1]).get("finalizing_at") or stamp
            return model.BatchClaim(self._merge(batch_id, {"status": "finalizing", "finalizing_at": since}), row[0])

    @threaded
    def renew_batch(self, batch_id: str, owner: str, lease_s: float) -> bool:
        with self._lock:
            cur = self._db.execute(
                "UPDATE batches SET lease_until = ? WHERE id = ? AND lease_owner = ?"
                " AND status IN ('validating', 'finalizing')",
                (time.time() + lease_s, batch_id, owner),
            )
        return cur.rowcount == 1

    @threaded
    def start_batch(
        self, batch_id: str, owner: str, rows: list[model.Row], groups: int, fields: dict[str, Any]
    ) -> bool:
        """A validated batch's requests, its ``groups`` (numbered from 0) and its new state (``fields``), in one
        transaction; False (nothing written) unless it is still validating under this owner's lease."""
        with self._tx() as db:
            if not _held(db, batch_id, owner, ("validating",)):
                return False
            db.executemany(
                insert("requests", model.REQUEST_COLUMNS),
                [model.request_record(batch_id, r) for r in rows],
            )
            db.executemany("INSERT INTO groups (batch_id, grp) VALUES (?, ?)", [(batch_id, g) for g in range(groups)])
            db.execute("UPDATE batches SET lease_owner = NULL, lease_until = NULL WHERE id = ?", (batch_id,))
            self._merge(batch_id, fields)
        return True

    @threaded
    def end_batch(self, batch_id: str, owner: str, fields: dict[str, Any], files: list[model.FileRow]) -> bool:
        """The batch's last state (completed, cancelled, failed) and its output files' rows, in one
        transaction; False (nothing written) unless this owner holds its lease."""
        now = int(time.time())
        with self._tx() as db:
            if not _held(db, batch_id, owner, ("validating", "finalizing")):
                return False
            db.executemany(
                "INSERT OR IGNORE INTO files (id, purpose, filename, bytes, created_at, owner)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [(f.id, f.purpose, f.filename, f.bytes, now, f.owner) for f in files],
            )
            db.execute("UPDATE batches SET lease_owner = NULL, lease_until = NULL WHERE id = ?", (batch_id,))
            self._merge(batch_id, fields)
        return True

    # --- the runner: groups and requests --------------------------------------------------------------------------

    @threaded
    def claim_group(self, owner: str, lease_s: float) -> model.GroupClaim | None:
        """The first open group of the oldest running batch that no live lease holds, now this owner's."""
        now = time.time()
        with self._tx() as db:
            row = db.execute(
                "SELECT g.batch_id, g.grp, json_extract(b.doc, '$.endpoint'), g.claims, b.owner"
                " FROM groups g JOIN batches b ON b.id = g.batch_id"
                " WHERE g.state = 'open' AND b.status = 'in_progress' AND (g.lease_until IS NULL OR g.lease_until < ?)"
                " ORDER BY b.created_at, b.id, g.grp LIMIT 1",
                (now,),
            ).fetchone()
            if row is None:
                return None
            batch_id, grp, endpoint, claims, batch_owner = row
            db.execute(
                "UPDATE groups SET lease_owner = ?, lease_until = ?, claims = claims + 1"
                " WHERE batch_id = ? AND grp = ?",
                (owner, now + lease_s, batch_id, grp),
            )
            pending = db.execute(
                "SELECT line, custom_id, body, affinity FROM requests"
                " WHERE batch_id = ? AND grp = ? AND state = 'pending' ORDER BY seq",
                (batch_id, grp),
            ).fetchall()
        return model.GroupClaim(
            batch_id,
            grp,
            endpoint,
            claims + 1,
            [model.Pending(a, b, json.loads(c), d) for a, b, c, d in pending],
            batch_owner,
        )

    @threaded
    def renew_groups(self, owner: str, keys: list[tuple[str, int]], lease_s: float) -> dict[tuple[str, int], str]:
        """Extend this owner's leases on ``keys``; those it still holds, with their batch's status."""
        until = time.time() + lease_s
        held: dict[tuple[str, int], str] = {}
        with self._lock:
            for batch_id, grp in keys:
                cur = self._db.execute(
                    "UPDATE groups SET lease_until = ?"
                    " WHERE batch_id = ? AND grp = ? AND lease_owner = ? AND state = 'open'",
                    (until, batch_id, grp, owner),
                )
                if cur.rowcount == 1:
                    (held[(batch_id, grp)],) = self._db.execute(
                        "SELECT status FROM batches WHERE id = ?", (batch_id,)
                    ).fetchone()
        return held

    @threaded
    def release_group(self, batch_id: str, grp: int, owner: str) -> None:
        """Give the group up: done when none of its requests is pending, else open to any runner now."""
        with self._lock:
            self._db.execute(
                "UPDATE groups SET lease_owner = NULL, lease_until = NULL, state = CASE WHEN EXISTS"
                " (SELECT 1 FROM requests r WHERE r.batch_id = ? AND r.grp = ? AND r.state = 'pending')"
                " THEN 'open' ELSE 'done' END WHERE batch_id = ? AND grp = ? AND lease_owner = ?",
                (batch_id, grp, batch_id, grp, owner),
            )

    @threaded
    def finish_request(self, batch_id: str, line: int, ok: bool, result: dict[str, Any]) -> bool:
        """Record one result; False when the request was already finished (never twice), or its
        batch is no longer running (a finalized output never changes)."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE requests SET state = ?, result = ? WHERE batch_id = ? AND line = ? AND state = 'pending'"
                " AND EXISTS (SELECT 1 FROM batches WHERE id = ? AND status IN ('in_progress', 'cancelling'))",
                ("done" if ok else "error", json.dumps(result), batch_id, line, batch_id),
            )
        return cur.rowcount == 1


def _held(db: sqlite3.Connection, batch_id: str, owner: str, statuses: tuple[str, ...]) -> bool:
    """Whether the batch is in one of ``statuses`` under ``owner``'s lease (in a transaction)."""
    query = f"SELECT 1 FROM batches WHERE id = ? AND status IN ({marks(statuses)}) AND lease_owner = ?"
    return db.execute(query, (batch_id, *statuses, owner)).fetchone() is not None
