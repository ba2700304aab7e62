"""Live-traffic quality in one SQLite file (the embedded default). Every gateway process of a
machine may open the same file: there is no lock of the store's own (unlike the batch store),
SQLite's WAL lets readers and a writer work at once, and a writer waits for another (its busy
timeout) rather than fail. Each method's body runs on a worker thread (``gateway/state/sqlite.py``).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.state.quality import model
from gateway.state.sqlite import SqliteStore, connect, insert, threaded
from gateway.state.stores import StoreDown

BUSY_TIMEOUT_S = 10.0  # a writer waits this long for another process's write before it fails

SCHEMA = """
CREATE TABLE IF NOT EXISTS quality_records (
    request_id TEXT PRIMARY KEY, at REAL NOT NULL, owner TEXT, model TEXT NOT NULL, kind TEXT NOT NULL,
    answered_by TEXT NOT NULL, top INTEGER NOT NULL, slice TEXT NOT NULL, cost REAL NOT NULL, prompt TEXT);
CREATE INDEX IF NOT EXISTS quality_records_at ON quality_records (at);
CREATE TABLE IF NOT EXISTS quality_pairs (
    request_id TEXT PRIMARY KEY, at REAL NOT NULL, kept TEXT NOT NULL, top_answer TEXT NOT NULL,
    agree INTEGER NOT NULL, cost REAL NOT NULL);
CREATE TABLE IF NOT EXISTS quality_feedback (
    request_id TEXT PRIMARY KEY, at REAL NOT NULL, verdict TEXT, score REAL);
"""


class SqliteQuality(SqliteStore):
    """The ``contract.QualityStore`` in one SQLite file that several processes may share; open it
    with :meth:`open` (the constructor blocks: it creates the folder and the tables)."""

    what = "the quality store"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = f"sqlite at {path}"
        path.parent.mkdir(parents=True, exist_ok=True)
        db = connect(path, timeout=BUSY_TIMEOUT_S)
        try:
            db.executescript("BEGIN IMMEDIATE;" + SCHEMA + "COMMIT;")
        except BaseException:
            db.close()
            raise
        self._attach(db)

    @classmethod
    async def open(cls, path: Path) -> SqliteQuality:
        """The store in the file ``path`` (made, with its folder, when absent), opened on a worker
        thread; :class:`StoreDown` when it cannot be opened or written."""
        try:
            return await asyncio.to_thread(cls, path)
        except (OSError, sqlite3.Error) as exc:
            raise StoreDown(
                f"the quality store (sqlite at {path}) cannot be opened: {type(exc).__name__}: {exc}"
            ) from None

    @threaded
    def close(self) -> None:
        self._close()

    @threaded
    def record(self, records: Sequence[model.Record]) -> None:
        if not records:
            return
        with self._tx() as db:
            db.executemany(
                insert("quality_records", model.RECORD_COLUMNS) + " ON CONFLICT (request_id) DO NOTHING",
                [model.record_row(r) for r in records],
            )

    @threaded
    def pair(self, pair: model.Pair) -> None:
        with self._lock:
            self._db.execute(
                insert("quality_pairs", model.PAIR_COLUMNS) + " ON CONFLICT (request_id) DO NOTHING",
                model.pair_row(pair),
            )

    @threaded
    def feedback(self, request_id: str, owner: str | None, at: float, verdict: str | None, score: float | None) -> bool:
        if "\x00" in request_id or (owner is not None and "\x00" in owner):
            return False  # no record holds one (:func:`clean`)
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO quality_feedback (request_id, at, verdict, score)"
                " SELECT request_id, ?, ?, ? FROM quality_records WHERE request_id = ? AND (? IS NULL OR owner = ?)"
                " ON CONFLICT (request_id) DO UPDATE SET at = excluded.at, verdict = excluded.verdict,"
                " score = excluded.score",
                (at, verdict, score, request_id, owner, owner),
            )
        return cur.rowcount == 1

    @threaded
    def counts(self, since: float) -> list[model.SliceCounts]:
        with self._lock:
            rows = self._db.execute(
                model.counts_select("?") + " ORDER BY r.model, r.kind, r.answered_by, r.slice, r.top",
                (since,),
            ).fetchall()
        return [model.slice_counts(r) for r in rows]

    @threaded
    def export(self, since: float, limit: int) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                model.EXPORT_SELECT + " AND r.at >= ? ORDER BY r.at DESC, r.request_id DESC LIMIT ?", (since, limit)
            ).fetchall()
        return [model.export_row(r) for r in rows]

    @threaded
    def prune(self, before: float) -> int:
        old = "SELECT request_id FROM quality_records WHERE at < ?"
        with self._tx() as db:
            db.execute(f"DELETE FROM quality_pairs WHERE at < ? OR request_id IN ({old})", (before, before))
            db.execute(f"DELETE FROM quality_feedback WHERE at < ? OR request_id IN ({old})", (before, before))
            return db.execute("DELETE FROM quality_records WHERE at < ?", (before,)).rowcount
