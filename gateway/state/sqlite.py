"""What every SQLite store shares (the batch store, the quality store): one connection, in WAL
mode, guarded by a lock, whose synchronous bodies the event loop awaits on a worker thread.

A store subclasses :class:`SqliteStore` and marks each method :func:`threaded`: the method's
body runs on a worker thread (the event loop never waits on SQLite), and sqlite3's failures are
:class:`StoreDown` (503) naming the store. A body takes ``self._lock`` for a read or a single
write, or ``self._tx()`` for a write transaction, so each method is atomic.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Concatenate, ParamSpec, TypeVar

from gateway.state.stores import StoreDown

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S", bound="SqliteStore")


def connect(path: Path, timeout: float) -> sqlite3.Connection:
    """A connection to the database file ``path`` that any thread may use (its store's lock guards
    it), in autocommit (transactions are explicit) and WAL mode; a writer waits ``timeout``
    seconds for another process's write before it fails."""
    db = sqlite3.connect(path, timeout=timeout, check_same_thread=False, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
    except BaseException:
        db.close()
        raise
    return db


def marks(columns: tuple[str, ...]) -> str:
    """One ``?`` a column: the placeholders of an INSERT of ``columns``."""
    return ", ".join("?" * len(columns))


def insert(table: str, columns: tuple[str, ...]) -> str:
    """``INSERT INTO table (columns...) VALUES (?, ...)``."""
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks(columns)})"


class SqliteStore:
    """A store on one SQLite connection (``_db``), guarded by ``_lock``; ``what`` names the store
    in messages ("the batch store"), ``where`` says where it is (never a password)."""

    what: ClassVar[str]
    where: str
    _db: sqlite3.Connection
    _lock: threading.Lock

    def _attach(self, db: sqlite3.Connection) -> None:
        self._db, self._lock = db, threading.Lock()

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

    def _close(self) -> None:
        with self._lock:
            self._db.close()


def threaded(fn: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """The store's method, awaited: its body runs on a worker thread, and sqlite3's failures are
    :class:`StoreDown` naming the store."""

    @functools.wraps(fn)
    async def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await asyncio.to_thread(fn, self, *args, **kwargs)
        except sqlite3.Error as exc:
            raise StoreDown(f"{self.what} ({self.where}) failed: {type(exc).__name__}: {exc}") from None

    return run
