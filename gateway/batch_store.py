"""Files and batch jobs of the Batch API, kept in SQLite and on disk so a restart loses nothing.

Every request of a batch is a row; its result is written in the same transaction that marks it
done, so a gateway restarted mid-batch runs exactly the requests that were not finished, and
never a finished one again. Synchronous (sqlite3 from the standard library): callers run it in
a worker thread. One connection, guarded by a lock.

Files and batches belong to the key that made them (``owner``: the key's sha256, None when the
gateway runs without keys). A ``viewer`` of None sees everything (no keys, or the runner itself);
any other viewer sees only what it owns, and anything else reads as absent.
"""

from __future__ import annotations

import fcntl
import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, owner TEXT, expires_at INTEGER);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, doc TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL, owner TEXT);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, body TEXT, state TEXT NOT NULL,
    result TEXT, PRIMARY KEY (batch_id, line));
CREATE INDEX IF NOT EXISTS requests_pending ON requests (batch_id, state);
"""
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


_MINE = " AND (? IS NULL OR owner = ?)"  # the viewer's rows; a viewer of None sees all
_LIVE = " AND (expires_at IS NULL OR expires_at > ?)"  # an expired file is gone, swept or not yet
_TYPES = {"owner": "TEXT", "expires_at": "INTEGER"}


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Pending:
    line: int
    custom_id: str
    body: dict[str, Any]


class StoreBusy(RuntimeError):
    """Another gateway process holds this store: two runners must never work one batch."""


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "files").mkdir(parents=True, exist_ok=True)
        self._lockfile = open(root / "lock", "w")  # noqa: SIM115 - held for the store's lifetime
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lockfile.close()
            raise StoreBusy(f"{root} is in use by another gateway process") from None
        self._db = sqlite3.connect(root / "batches.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        # a store made before owners or expiry: its rows have none
        for table, column in (("files", "owner"), ("batches", "owner"), ("files", "expires_at")):
            if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {_TYPES[column]}")
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._lockfile.close()  # releases the flock

    # --- files ------------------------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def add_file(
        self, content: bytes, filename: str, purpose: str, owner: str | None = None, expires_after: int | None = None
    ) -> dict[str, Any]:
        """A new file; ``expires_after``: seconds from now after which it is gone (None: never)."""
        file_id = new_id("file-")
        tmp = self.file_path(file_id).with_suffix(".part")
        tmp.write_bytes(content)
        tmp.rename(self.file_path(file_id))  # the row only ever points at a whole file
        now = int(time.time())
        expires_at = now + expires_after if expires_after is not None else None
        with self._lock:
            self._db.execute(
                "INSERT INTO files (id, purpose, filename, bytes, created_at, owner, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (file_id, purpose, filename, len(content), now, owner, expires_at),
            )
        return self.file(file_id) or {}

    def file(self, file_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, purpose, filename, bytes, created_at, expires_at FROM files WHERE id = ?" + _MINE + _LIVE,
                (file_id, viewer, viewer, int(time.time())),
            ).fetchone()
        if row is None:
            return None
        return {
            "id": row[0],
            "object": "file",
            "purpose": row[1],
            "filename": row[2],
            "bytes": row[3],
            "created_at": row[4],
            "status": "processed",
            "expires_at": row[5],
            "status_details": None,
        }

    def delete_file(self, file_id: str, viewer: str | None = None) -> bool:
        """Remove the file (row, then bytes); False when ``viewer`` has no such file."""
        with self._lock:
            cur = self._db.execute("DELETE FROM files WHERE id = ?" + _MINE, (file_id, viewer, viewer))
        if cur.rowcount == 1:
            self.file_path(file_id).unlink(missing_ok=True)
        return cur.rowcount == 1

    def sweep(self, now: float | None = None) -> list[str]:
        """Remove every file past its ``expires_at``; the ids removed."""
        stamp = int(time.time() if now is None else now)
        with self._lock:
            ids = [r[0] for r in self._db.execute("SELECT id FROM files WHERE expires_at <= ?", (stamp,))]
            self._db.executemany("DELETE FROM files WHERE id = ?", [(i,) for i in ids])
        for file_id in ids:
            self.file_path(file_id).unlink(missing_ok=True)
        return ids

    # --- batches ----------------------------------------------------------------------------------------------

    def add_batch(self, doc: dict[str, Any], owner: str | None = None) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO batches (id, doc, status, created_at, owner) VALUES (?, ?, ?, ?, ?)",
                (doc["id"], json.dumps(doc), doc["status"], doc["created_at"], owner),
            )

    def batch(self, batch_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT doc FROM batches WHERE id = ?" + _MINE, (batch_id, viewer, viewer)
            ).fetchone()
        return json.loads(row[0]) if row else None

    def batch_owner(self, batch_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] if row else None

    def save_batch(self, doc: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE batches SET doc = ?, status = ? WHERE id = ?", (json.dumps(doc), doc["status"], doc["id"])
            )

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

    def active_batches(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT doc FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))}) ORDER BY created_at", ACTIVE
            ).fetchall()
        return [json.loads(r[0]) for r in rows]

    # --- requests ---------------------------------------------------------------------------------------------

    def add_requests(
        self, batch_id: str, rows: list[tuple[int, str | None, dict | None, dict | None]], doc: dict[str, Any]
    ) -> None:
        """Every line of a validated input file (line, custom_id, body or None, error result or None)
        and the batch's new state, in one transaction."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT OR IGNORE INTO requests VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (
                            batch_id,
                            line,
                            cid,
                            json.dumps(body) if body is not None else None,
                            "pending" if error is None else "error",
                            json.dumps(error) if error is not None else None,
                        )
                        for line, cid, body, error in rows
                    ],
                )
                self._db.execute(
                    "UPDATE batches SET doc = ?, status = ? WHERE id = ?", (json.dumps(doc), doc["status"], batch_id)
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def pending(self, batch_id: str) -> list[Pending]:
        with self._lock:
            rows = self._db.execute(
                "SELECT line, custom_id, body FROM requests WHERE batch_id = ? AND state = 'pending' ORDER BY line",
                (batch_id,),
            ).fetchall()
        return [Pending(line, cid, json.loads(body)) for line, cid, body in rows]

    def finish_request(self, batch_id: str, line: int, ok: bool, result: dict[str, Any]) -> bool:
        """Record one result; False when the request was already finished (never twice)."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE requests SET state = ?, result = ? WHERE batch_id = ? AND line = ? AND state = 'pending'",
                ("done" if ok else "error", json.dumps(result), batch_id, line),
            )
        return cur.rowcount == 1

    def counts(self, batch_id: str) -> dict[str, int]:
        with self._lock:
            rows = dict(
                self._db.execute(
                    "SELECT state, COUNT(*) FROM requests WHERE batch_id = ? GROUP BY state", (batch_id,)
                ).fetchall()
            )
        done, error, pending = rows.get("done", 0), rows.get("error", 0), rows.get("pending", 0)
        return {"total": done + error + pending, "completed": done, "failed": error}

    def results(self, batch_id: str, state: str) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT result FROM requests WHERE batch_id = ? AND state = ? ORDER BY line", (batch_id, state)
            ).fetchall()
        return [r[0] for r in rows]
