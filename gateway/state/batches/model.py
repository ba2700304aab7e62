"""The Batch API's job model: what the stores (``sqlite.py``, SQLite; ``pg.py``, PostgreSQL) and
the runner share. No I/O but a file's bytes."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def output_file_id(batch_id: str, state: str) -> str:
    """The id of a batch's output (``done``) or error file: the same whoever finalizes it, so a
    finalizer that takes over from a dead one writes the same file, never a second one."""
    return "file-" + hashlib.sha256(f"{batch_id}/{state}".encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Pending:
    line: int
    custom_id: str
    body: dict[str, Any]
    affinity: str | None = None  # its prefix group's key: the group's requests go to one replica


class Row(NamedTuple):
    """One line of a validated input file: a request to run (``body``; the group it is claimed
    with, its place in the plan, its prefix group's affinity key) or an error result (``error``)
    for the error file."""

    line: int
    custom_id: str | None
    body: dict[str, Any] | None
    error: dict[str, Any] | None
    grp: int | None = None
    seq: int = 0
    affinity: str | None = None


REQUEST_COLUMNS = ("batch_id", "line", "custom_id", "body", "state", "result", "grp", "seq", "affinity")


def request_record(batch_id: str, r: Row) -> tuple[Any, ...]:
    """A validated line as both stores keep it, in ``REQUEST_COLUMNS``' order: a request to run is
    pending, an invalid line is written already as its error result."""
    body = json.dumps(r.body) if r.body is not None else None
    error = json.dumps(r.error) if r.error is not None else None
    state = "pending" if r.error is None else "error"
    return (batch_id, r.line, r.custom_id, body, state, error, r.grp, r.seq, r.affinity)


class FileRow(NamedTuple):
    """An output file's metadata, written with the batch's final state (its bytes are already on disk)."""

    id: str
    filename: str
    purpose: str
    bytes: int
    owner: str | None


@dataclass(frozen=True)
class BatchClaim:
    """A batch this runner now validates or finalizes (it holds the batch's lease)."""

    doc: dict[str, Any]
    owner: str | None  # the key the batch belongs to: its output files are that key's


@dataclass(frozen=True)
class GroupClaim:
    """A group this runner now holds (a prefix group, a part of a big one, or single requests
    packed together: ``gateway/batch/lines.py``), with its requests not yet done."""

    batch_id: str
    grp: int
    endpoint: str
    claims: int  # times the group was claimed: above 1, taken over from a runner that stopped
    pending: list[Pending]
    owner: str | None = None  # the batch's: the sha256 of the key that made it (charged for its lines)


class NewFile(NamedTuple):
    """A new file's row, in ``FILE_COLUMNS``' order (its bytes already on disk)."""

    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    owner: str | None
    expires_at: int | None

    def doc(self) -> dict[str, Any]:
        return file_doc((self.id, self.purpose, self.filename, self.bytes, self.created_at, self.expires_at))


FILE_COLUMNS = NewFile._fields


class FileFolder:
    """The folder of files' bytes (``files/<id>``) that both stores keep beside their rows."""

    root: Path

    def file_path(self, file_id: str) -> Path:
        return self.root / "files" / file_id

    def write_file(
        self, content: bytes, filename: str, purpose: str, owner: str | None, expires_after: int | None
    ) -> NewFile:
        """A new file's bytes, written whole (a row only ever points at a whole file), and its row;
        ``expires_after``: seconds from now after which it is gone (None: never)."""
        file_id, now = new_id("file-"), int(time.time())
        write_bytes(self.file_path(file_id), content)
        expires_at = now + expires_after if expires_after is not None else None
        return NewFile(file_id, purpose, filename, len(content), now, owner, expires_at)


def file_doc(row: tuple[Any, ...]) -> dict[str, Any]:
    """(id, purpose, filename, bytes, created_at, expires_at) as the API's file object."""
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


def counts_of(states: dict[str, int]) -> dict[str, int]:
    done, error, pending = states.get("done", 0), states.get("error", 0), states.get("pending", 0)
    return {"total": done + error + pending, "completed": done, "failed": error}


def write_bytes(path: Path, content: bytes) -> None:
    """A file's bytes, whole or not at all: written aside (a name of its own, so two writers never
    share one), then renamed onto ``path``."""
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.part")
    tmp.write_bytes(content)
    tmp.rename(path)
