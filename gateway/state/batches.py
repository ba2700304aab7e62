"""The Batch API's store, one async interface with two engines chosen by the policy's
``state.database``:

- unset: SQLite and the ``batches.dir`` folder (``gateway/state/batch_store.py``), one gateway process
  (the embedded default; nothing to run);
- ``postgresql://...``: batches, requests, groups and files' metadata in PostgreSQL
  (``gateway/state/batch_pg.py``), shared by every gateway pointing at it; files' bytes stay on
  ``batches.dir``, which those gateways then share (a volume every one mounts).

A store that fails raises :class:`gateway.state.stores.StoreDown` (503, OpenAI's error shape), and
nothing is half-written: every write that changes more than one row is one transaction.

:class:`Batches` is the interface, written once: both stores implement it as they are (SQLite's runs
each method's body on a worker thread, ``batch_store._threaded``), and ``tests/test_batch_contract.py``
holds both to the same assertions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from backends.secrets import MissingSecret, lookup
from gateway.state.batch_model import BatchClaim, FileRow, GroupClaim, Row
from gateway.state.batch_store import BatchStore
from gateway.state.stores import StoreDown
from policies.schema import StateSpec


class Batches(Protocol):
    """Files and batch jobs (see ``gateway/state/batch_store.py`` for the model and its guarantees);
    :class:`BatchStore` and ``gateway.state.batch_pg.PgBatches`` are its two engines."""

    root: Path  # the folder of files' bytes (``files/<id>``)
    where: str  # the store, for messages: never a password

    def file_path(self, file_id: str) -> Path: ...

    async def add_file(
        self, content: bytes, filename: str, purpose: str, owner: str | None = None, expires_after: int | None = None
    ) -> dict[str, Any]: ...

    async def file(self, file_id: str, viewer: str | None = None) -> dict[str, Any] | None: ...

    async def delete_file(self, file_id: str, viewer: str | None = None) -> bool: ...

    async def sweep(self) -> list[str]: ...

    async def add_batch(self, doc: dict[str, Any], owner: str | None = None) -> None: ...

    async def batch(self, batch_id: str, viewer: str | None = None) -> dict[str, Any] | None: ...

    async def batches(self, limit: int, after: str | None, viewer: str | None = None) -> list[dict[str, Any]]: ...

    async def cancel(self, batch_id: str, viewer: str | None, now: int) -> dict[str, Any] | None: ...

    async def counts(self, batch_id: str) -> dict[str, int]: ...

    async def results(self, batch_id: str, state: str) -> list[str]: ...

    async def work(self) -> list[tuple[str, str]]: ...

    async def claim_validation(self, batch_id: str, owner: str, lease_s: float) -> BatchClaim | None: ...

    async def claim_finalization(self, batch_id: str, owner: str, lease_s: float, stamp: int) -> BatchClaim | None: ...

    async def renew_batch(self, batch_id: str, owner: str, lease_s: float) -> bool: ...

    async def start_batch(
        self, batch_id: str, owner: str, rows: list[Row], groups: int, fields: dict[str, Any]
    ) -> bool: ...

    async def end_batch(self, batch_id: str, owner: str, fields: dict[str, Any], files: list[FileRow]) -> bool: ...

    async def claim_group(self, owner: str, lease_s: float) -> GroupClaim | None: ...

    async def renew_groups(
        self, owner: str, keys: list[tuple[str, int]], lease_s: float
    ) -> dict[tuple[str, int], str]: ...

    async def release_group(self, batch_id: str, grp: int, owner: str) -> None: ...

    async def finish_request(self, batch_id: str, line: int, ok: bool, result: dict[str, Any]) -> bool: ...

    async def close(self) -> None: ...


async def open_batches(spec: StateSpec, root: Path) -> Batches:
    """The policy's batch store on ``root`` (files' bytes, and SQLite's database): PostgreSQL when
    ``state.database`` is set, checked now (:class:`StoreDown` naming it when it cannot be
    reached); else SQLite (:class:`gateway.state.batch_store.StoreBusy` when another process holds it)."""
    if spec.database is None:
        return await BatchStore.open(root)
    try:
        dsn = lookup(spec.database) if spec.database.startswith("env:") else spec.database
    except MissingSecret as exc:
        raise StoreDown(f"state.database: {exc}") from None
    assert dsn is not None
    from gateway.state.batch_pg import PgBatches

    return await PgBatches.open(dsn, root)
