"""The Batch API's store, one async interface with two engines chosen by the policy's
``state.database``:

- unset: SQLite and the ``batches.dir`` folder (``gateway/state/batch_store.py``), one gateway process
  (the embedded default; nothing to run);
- ``postgresql://...``: batches, requests, groups and files' metadata in PostgreSQL
  (``gateway/state/batch_pg.py``), shared by every gateway pointing at it; files' bytes stay on
  ``batches.dir``, which those gateways then share (a volume every one mounts).

A store that fails raises :class:`gateway.state.stores.StoreDown` (503, OpenAI's error shape), and
nothing is half-written: every write that changes more than one row is one transaction.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from backends.secrets import MissingSecret, resolve
from gateway.state.batch_model import BatchClaim, FileRow, GroupClaim, Row
from gateway.state.batch_store import BatchStore
from gateway.state.stores import StoreDown
from policies.schema import StateSpec

T = TypeVar("T")


class Batches(Protocol):
    """Files and batch jobs (see ``gateway/state/batch_store.py`` for the model and its guarantees)."""

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


class SqliteBatches:
    """:class:`BatchStore` (synchronous) on worker threads; its failures are :class:`StoreDown`."""

    def __init__(self, store: BatchStore) -> None:
        self.store = store
        self.root = store.root
        self.where = f"sqlite at {store.root / 'batches.sqlite3'}"

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args)
        except sqlite3.Error as exc:
            raise StoreDown(f"the batch store ({self.where}) failed: {type(exc).__name__}: {exc}") from None

    def file_path(self, file_id: str) -> Path:
        return self.store.file_path(file_id)

    async def add_file(
        self, content: bytes, filename: str, purpose: str, owner: str | None = None, expires_after: int | None = None
    ) -> dict[str, Any]:
        return await self._run(self.store.add_file, content, filename, purpose, owner, expires_after)

    async def file(self, file_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        return await self._run(self.store.file, file_id, viewer)

    async def delete_file(self, file_id: str, viewer: str | None = None) -> bool:
        return await self._run(self.store.delete_file, file_id, viewer)

    async def sweep(self) -> list[str]:
        return await self._run(self.store.sweep)

    async def add_batch(self, doc: dict[str, Any], owner: str | None = None) -> None:
        await self._run(self.store.add_batch, doc, owner)

    async def batch(self, batch_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        return await self._run(self.store.batch, batch_id, viewer)

    async def batches(self, limit: int, after: str | None, viewer: str | None = None) -> list[dict[str, Any]]:
        return await self._run(self.store.batches, limit, after, viewer)

    async def cancel(self, batch_id: str, viewer: str | None, now: int) -> dict[str, Any] | None:
        return await self._run(self.store.cancel, batch_id, viewer, now)

    async def counts(self, batch_id: str) -> dict[str, int]:
        return await self._run(self.store.counts, batch_id)

    async def results(self, batch_id: str, state: str) -> list[str]:
        return await self._run(self.store.results, batch_id, state)

    async def work(self) -> list[tuple[str, str]]:
        return await self._run(self.store.work)

    async def claim_validation(self, batch_id: str, owner: str, lease_s: float) -> BatchClaim | None:
        return await self._run(self.store.claim_validation, batch_id, owner, lease_s)

    async def claim_finalization(self, batch_id: str, owner: str, lease_s: float, stamp: int) -> BatchClaim | None:
        return await self._run(self.store.claim_finalization, batch_id, owner, lease_s, stamp)

    async def renew_batch(self, batch_id: str, owner: str, lease_s: float) -> bool:
        return await self._run(self.store.renew_batch, batch_id, owner, lease_s)

    async def start_batch(
        self, batch_id: str, owner: str, rows: list[Row], groups: int, fields: dict[str, Any]
    ) -> bool:
        return await self._run(self.store.start_batch, batch_id, owner, rows, groups, fields)

    async def end_batch(self, batch_id: str, owner: str, fields: dict[str, Any], files: list[FileRow]) -> bool:
        return await self._run(self.store.end_batch, batch_id, owner, fields, files)

    async def claim_group(self, owner: str, lease_s: float) -> GroupClaim | None:
        return await self._run(self.store.claim_group, owner, lease_s)

    async def renew_groups(self, owner: str, keys: list[tuple[str, int]], lease_s: float) -> dict[tuple[str, int], str]:
        return await self._run(self.store.renew_groups, owner, keys, lease_s)

    async def release_group(self, batch_id: str, grp: int, owner: str) -> None:
        await self._run(self.store.release_group, batch_id, grp, owner)

    async def finish_request(self, batch_id: str, line: int, ok: bool, result: dict[str, Any]) -> bool:
        return await self._run(self.store.finish_request, batch_id, line, ok, result)

    async def close(self) -> None:
        await asyncio.to_thread(self.store.close)


async def open_batches(spec: StateSpec, root: Path) -> Batches:
    """The policy's batch store on ``root`` (files' bytes, and SQLite's database): PostgreSQL when
    ``state.database`` is set, checked now (:class:`StoreDown` naming it when it cannot be
    reached); else SQLite (:class:`gateway.state.batch_store.StoreBusy` when another process holds it)."""
    if spec.database is None:
        return SqliteBatches(await asyncio.to_thread(BatchStore, root))
    try:
        dsn = resolve(spec.database) if spec.database.startswith("env:") else spec.database
    except MissingSecret as exc:
        raise StoreDown(f"state.database: {exc}") from None
    assert dsn is not None
    from gateway.state.batch_pg import PgBatches

    return await PgBatches.open(dsn, root)
