"""The store of live-traffic quality: how often the answers of a tracked virtual model agree with
its top tier's, measured on the requests it actually serves. One async interface
(:class:`QualityStore`) with two engines chosen by the policy's ``state.database``, as the Batch
API's store is (``gateway/state/batches/``), and laid out as it is: ``model.py``, ``contract.py``,
``sqlite.py``, ``pg.py``:

- unset: SQLite in one file (:class:`SqliteQuality`, ``sqlite.py``), which every gateway process of
  a machine may open;
- ``postgresql://...`` (or ``env:NAME`` holding it): tables ``quality_records``, ``quality_pairs``
  and ``quality_feedback`` in PostgreSQL (``pg.py``), shared by every gateway pointing at it.

The model (``model.py``), three tables keyed by the request's id:

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

Text is kept without NUL characters (``model.clean``): PostgreSQL's text cannot hold one.

A store that fails raises :class:`gateway.state.stores.StoreDown`, naming the store (never a
password); a write of many rows is one transaction.
"""

from __future__ import annotations

from pathlib import Path

from gateway.state.quality.contract import QualityStore
from gateway.state.quality.model import Pair, Record, SliceCounts
from gateway.state.quality.sqlite import SqliteQuality
from policies.schema import StateSpec

__all__ = ["Pair", "QualityStore", "Record", "SliceCounts", "SqliteQuality", "open_quality"]


async def open_quality(state: StateSpec, path: Path) -> QualityStore:
    """The policy's quality store: PostgreSQL when ``state.database`` is set, checked now
    (:class:`StoreDown` naming it when it cannot be reached, or when the variable it names is
    unset); else SQLite in the file ``path``."""
    if state.database is None:
        return await SqliteQuality.open(path)
    from gateway.state.pg import database_dsn
    from gateway.state.quality.pg import PgQuality

    return await PgQuality.open(database_dsn(state))
