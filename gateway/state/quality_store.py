"""The store of live-traffic quality: how often the answers of a tracked virtual model agree with
its top tier's, measured on the requests it actually serves. One async interface
(:class:`QualityStore`) with two engines chosen by the policy's ``state.database``, as the Batch
API's store is (``gateway/state/batches.py``):

- unset: SQLite in one file (:class:`SqliteQuality`, here). Every gateway process of a machine may
  open the same file: there is no lock of the store's own (unlike the batch store), SQLite's WAL
  lets readers and a writer work at once, and a writer waits for another (its busy timeout)
  rather than fail;
- ``postgresql://...`` (or ``env:NAME`` holding it): tables ``quality_records``, ``quality_pairs``
  and ``quality_feedback`` in PostgreSQL (``gateway/state/quality_pg.py``), shared by every
  gateway pointing at it.

The model, three tables keyed by the request's id:

- a :class:`Record` for every answered request of a tracked model: who answered it (a cascade's
  tier, or the model a routed model chose), whether that was the top tier, the question's slice,
  what it cost. Recording is idempotent: a request already recorded is left as it was;
- a :class:`Pair` for some of them: the answer the caller kept beside the top tier's answer to
  the same request, asked in the background, and whether the two agree. One per request: a
  second is ignored;
- feedback a caller sends on one of its own requests: a verdict (``right``/``wrong``), a score,
  or both. The latest replaces the earlier.

:meth:`QualityStore.counts` sums them by slice (:class:`SliceCounts`), from which the gateway
estimates agreement with the top tier; :meth:`QualityStore.export` gives the checked requests
row by row; :meth:`QualityStore.prune` forgets what is older than the retention.

Ownership is the batch store's: ``owner`` is the caller key's sha256 (None when the gateway runs
without keys). An ``owner`` of None gives feedback on any record; any other only on its own.

Text is kept without NUL characters: PostgreSQL's text cannot hold one, and rather than refuse a
request's record (written in the background, long after its answer) both engines strip them
(:func:`clean`), so the two keep the same text. An id or owner holding a NUL matches nothing.

A store that fails raises :class:`gateway.state.stores.StoreDown`, naming the store (never a
password); a write of many rows is one transaction.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from backends.secrets import MissingSecret, lookup
from gateway.state.stores import StoreDown
from policies.schema import StateSpec

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

RECORD_COLUMNS = ("request_id", "at", "owner", "model", "kind", "answered_by", "top", "slice", "cost", "prompt")
PAIR_COLUMNS = ("request_id", "at", "kept", "top_answer", "agree", "cost")
EXPORT_COLUMNS = (*RECORD_COLUMNS, "kept", "top_answer", "agree", "verdict", "score")
GROUP = ("model", "kind", "answered_by", "top", "slice")


@dataclass(frozen=True, slots=True)
class Record:
    """One answered request of a tracked model."""

    request_id: str
    at: float  # unix seconds
    owner: str | None  # the caller key's sha256 (None: the gateway runs without keys)
    model: str  # the virtual model the request named
    kind: str  # "cascade" | "routed"
    answered_by: str  # the cascade tier's name, or the routed model's chosen model
    top: bool  # answered by the top tier / the reference model itself
    slice: str  # the question type for a cascade ("choice", "yes_no", "score"), "" for routed
    cost: float  # what the request's answer cost, in the policy's money
    prompt: str | None = None  # the question text, only where the policy allows logging prompts


@dataclass(frozen=True, slots=True)
class Pair:
    """A shadow check of one record."""

    request_id: str
    at: float
    kept: str  # the answer the caller got
    top_answer: str  # the top tier's answer to the same request
    agree: bool
    cost: float  # what the shadow call cost (the operator's money)


@dataclass(frozen=True, slots=True)
class SliceCounts:
    """One row of the summary: the records of one (model, kind, answered_by, top, slice)."""

    model: str
    kind: str
    answered_by: str
    top: bool
    slice: str
    records: int
    pairs: int
    agree: int
    right: int  # feedback verdicts "right"
    wrong: int  # feedback verdicts "wrong"
    scored: int  # feedback with a score
    score_sum: float
    shadow_cost: float
    cost: float  # sum of the records' cost


class QualityStore(Protocol):
    """Records, shadow pairs and feedback (see the module's docstring); :class:`SqliteQuality` and
    ``gateway.state.quality_pg.PgQuality`` are its two engines."""

    where: str  # the store, for messages: never a password

    async def close(self) -> None: ...

    async def record(self, records: Sequence[Record]) -> None:
        """Keep ``records``, in one transaction; a request_id already recorded is left as it was."""
        ...

    async def pair(self, pair: Pair) -> None:
        """Keep a shadow pair; a request_id that has one already keeps it (the second is ignored)."""
        ...

    async def feedback(
        self, request_id: str, owner: str | None, at: float, verdict: str | None, score: float | None
    ) -> bool:
        """Feedback on a record, replacing any earlier; False when ``owner`` has no record of that id
        (an ``owner`` of None: when there is none at all). ``verdict`` is "right", "wrong" or None,
        ``score`` a float or None; the caller checks them."""
        ...

    async def counts(self, since: float) -> list[SliceCounts]:
        """The records at or after ``since``, summed by slice, ordered by model, kind, answered_by, slice."""
        ...

    async def export(self, since: float, limit: int) -> list[dict[str, Any]]:
        """The records at or after ``since`` that have a pair or feedback, newest first, at most
        ``limit``: every :class:`Record` field, and ``kept``, ``top_answer``, ``agree`` (None
        without a pair), ``verdict``, ``score``."""
        ...

    async def prune(self, before: float) -> int:
        """Forget the records older than ``before``, with their pairs and feedback (and pairs and
        feedback older than it whose record was never written); how many records."""
        ...


def clean(text: str | None) -> str | None:
    """``text`` without NUL characters (PostgreSQL's text cannot hold one; SQLite keeps the same)."""
    return None if text is None else text.replace("\x00", "")


def record_row(r: Record) -> tuple[Any, ...]:
    """A record's values, in :data:`RECORD_COLUMNS` order, its text cleaned."""
    return (
        clean(r.request_id),
        r.at,
        clean(r.owner),
        clean(r.model),
        clean(r.kind),
        clean(r.answered_by),
        r.top,
        clean(r.slice),
        r.cost,
        clean(r.prompt),
    )


def pair_row(p: Pair) -> tuple[Any, ...]:
    """A pair's values, in :data:`PAIR_COLUMNS` order, its text cleaned."""
    return (clean(p.request_id), p.at, clean(p.kept), clean(p.top_answer), p.agree, p.cost)


def slice_counts(row: Sequence[Any]) -> SliceCounts:
    """A summary row as both engines select it: the :data:`GROUP` columns, then the sums in field order."""
    model, kind, answered_by, top, slice_ = row[:5]
    records, pairs, agree, right, wrong, scored = (int(v) for v in row[5:11])
    score_sum, shadow_cost, cost = (float(v) for v in row[11:])
    return SliceCounts(
        model,
        kind,
        answered_by,
        bool(top),
        slice_,
        records,
        pairs,
        agree,
        right,
        wrong,
        scored,
        score_sum,
        shadow_cost,
        cost,
    )


def export_row(row: Sequence[Any]) -> dict[str, Any]:
    """An exported row as both engines select it (:data:`EXPORT_COLUMNS`), booleans as booleans."""
    out = dict(zip(EXPORT_COLUMNS, row, strict=True))
    out["top"] = bool(out["top"])
    out["agree"] = None if out["agree"] is None else bool(out["agree"])
    return out


def counts_select(since: str) -> str:
    """The summary's SELECT, for either engine (``since``: its placeholder), without its ORDER BY."""
    group = ", ".join(f"r.{c}" for c in GROUP)
    return (
        f"SELECT {group}, count(*), count(p.request_id), coalesce(sum(CASE WHEN p.agree THEN 1 ELSE 0 END), 0),"
        " coalesce(sum(CASE WHEN f.verdict = 'right' THEN 1 ELSE 0 END), 0),"
        " coalesce(sum(CASE WHEN f.verdict = 'wrong' THEN 1 ELSE 0 END), 0),"
        " count(f.score), coalesce(sum(f.score), 0), coalesce(sum(p.cost), 0), coalesce(sum(r.cost), 0)"
        " FROM quality_records r"
        " LEFT JOIN quality_pairs p ON p.request_id = r.request_id"
        " LEFT JOIN quality_feedback f ON f.request_id = r.request_id"
        f" WHERE r.at >= {since} GROUP BY {group}"
    )


EXPORT_SELECT = (
    "SELECT "
    + ", ".join(f"r.{c}" for c in RECORD_COLUMNS)
    + ", p.kept, p.top_answer, p.agree, f.verdict, f.score FROM quality_records r"
    " LEFT JOIN quality_pairs p ON p.request_id = r.request_id"
    " LEFT JOIN quality_feedback f ON f.request_id = r.request_id"
    " WHERE (p.request_id IS NOT NULL OR f.request_id IS NOT NULL)"
)


P = ParamSpec("P")
T = TypeVar("T")


def _threaded(
    fn: Callable[Concatenate[SqliteQuality, P], T],
) -> Callable[Concatenate[SqliteQuality, P], Coroutine[Any, Any, T]]:
    """The store's method, awaited: its body runs on a worker thread (the event loop never waits on
    SQLite), and sqlite3's failures are :class:`StoreDown` (503) naming the store."""

    @functools.wraps(fn)
    async def run(self: SqliteQuality, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await asyncio.to_thread(fn, self, *args, **kwargs)
        except sqlite3.Error as exc:
            raise StoreDown(f"the quality store ({self.where}) failed: {type(exc).__name__}: {exc}") from None

    return run


class SqliteQuality:
    """The :class:`QualityStore` in one SQLite file that several processes may share; open it with
    :meth:`open` (the constructor blocks: it creates the folder and the tables)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = f"sqlite at {path}"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript("BEGIN IMMEDIATE;" + SCHEMA + "COMMIT;")
        except BaseException:
            self._db.close()
            raise
        self._lock = threading.Lock()

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

    @_threaded
    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction, taken at once (another process's writer makes it wait, never fail midway)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    @_threaded
    def record(self, records: Sequence[Record]) -> None:
        if not records:
            return
        with self._tx() as db:
            db.executemany(
                f"INSERT INTO quality_records ({', '.join(RECORD_COLUMNS)})"
                f" VALUES ({', '.join('?' * len(RECORD_COLUMNS))}) ON CONFLICT (request_id) DO NOTHING",
                [record_row(r) for r in records],
            )

    @_threaded
    def pair(self, pair: Pair) -> None:
        with self._lock:
            self._db.execute(
                f"INSERT INTO quality_pairs ({', '.join(PAIR_COLUMNS)})"
                f" VALUES ({', '.join('?' * len(PAIR_COLUMNS))}) ON CONFLICT (request_id) DO NOTHING",
                pair_row(pair),
            )

    @_threaded
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

    @_threaded
    def counts(self, since: float) -> list[SliceCounts]:
        with self._lock:
            rows = self._db.execute(
                counts_select("?") + " ORDER BY r.model, r.kind, r.answered_by, r.slice, r.top",
                (since,),
            ).fetchall()
        return [slice_counts(r) for r in rows]

    @_threaded
    def export(self, since: float, limit: int) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                EXPORT_SELECT + " AND r.at >= ? ORDER BY r.at DESC, r.request_id DESC LIMIT ?", (since, limit)
            ).fetchall()
        return [export_row(r) for r in rows]

    @_threaded
    def prune(self, before: float) -> int:
        old = "SELECT request_id FROM quality_records WHERE at < ?"
        with self._tx() as db:
            db.execute(f"DELETE FROM quality_pairs WHERE at < ? OR request_id IN ({old})", (before, before))
            db.execute(f"DELETE FROM quality_feedback WHERE at < ? OR request_id IN ({old})", (before, before))
            return db.execute("DELETE FROM quality_records WHERE at < ?", (before,)).rowcount


async def open_quality(state: StateSpec, path: Path) -> QualityStore:
    """The policy's quality store: PostgreSQL when ``state.database`` is set, checked now
    (:class:`StoreDown` naming it when it cannot be reached); else SQLite in the file ``path``."""
    if state.database is None:
        return await SqliteQuality.open(path)
    try:
        dsn = lookup(state.database) if state.database.startswith("env:") else state.database
    except MissingSecret as exc:
        raise StoreDown(f"state.database: {exc}") from None
    assert dsn is not None
    from gateway.state.quality_pg import PgQuality

    return await PgQuality.open(dsn)
