"""The Batch API's store, one async interface (:class:`Batches`, ``contract.py``) with two engines
chosen by the policy's ``state.database``:

- unset: SQLite and the ``batches.dir`` folder (``sqlite.py``), one gateway process (the embedded
  default; nothing to run);
- ``postgresql://...`` (or ``env:NAME`` holding it): batches, requests, groups and files' metadata
  in PostgreSQL (``pg.py``), shared by every gateway pointing at it; files' bytes stay on
  ``batches.dir``, which those gateways then share (a volume every one mounts).

``model.py`` holds what both engines and the runner share. A store that fails raises
:class:`gateway.state.stores.StoreDown` (503, OpenAI's error shape), and nothing is half-written:
every write that changes more than one row is one transaction.
"""

from __future__ import annotations

from pathlib import Path

from gateway.state.batches.contract import Batches
from gateway.state.batches.sqlite import BatchStore, StoreBusy
from policies.schema import StateSpec

__all__ = ["BatchStore", "Batches", "StoreBusy", "open_batches"]


async def open_batches(spec: StateSpec, root: Path) -> Batches:
    """The policy's batch store on ``root`` (files' bytes, and SQLite's database): PostgreSQL when
    ``state.database`` is set, checked now (:class:`StoreDown` naming it when it cannot be
    reached, or when the variable it names is unset); else SQLite (:class:`StoreBusy` when another
    process holds it)."""
    if spec.database is None:
        return await BatchStore.open(root)
    from gateway.state.batches.pg import PgBatches
    from gateway.state.pg import database_dsn

    return await PgBatches.open(database_dsn(spec), root)
