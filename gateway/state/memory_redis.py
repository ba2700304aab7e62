"""The cascade's memory of escalations, shared by every gateway on one Redis (``state.store: redis``
and ``cascade.memory.shared``, issue 56): what one gateway's last tier answered becomes a solved
example for the cheap tiers of all of them.

Each gateway keeps its own ring (``policies/memory.py``), which the requests read; this feed keeps
the rings in step through one Redis stream, and no request waits on Redis:

- :meth:`MemoryFeed.push` (a remembered answer) only appends to a bounded buffer; one task drains
  it every ``flush_s`` in one round trip (an ``XADD`` per entry, the stream trimmed to about the
  memory's ``size``).
- :meth:`MemoryFeed.freshen`, called as a question is recalled, starts a read of what the other
  gateways added since the last one, at most every ``sync_s`` (``XREAD`` after the last entry seen,
  in chunks); the first read after a start takes the whole stream, so a new or restarted gateway
  begins with the fleet's memory.

The stream is named by the encoder's kept layers (embeddings of another depth do not compare); an
entry whose embedding has another length than this ring's, or that does not parse, is skipped and
counted. A write or read that fails (Redis down or slow) is logged once per outage of each and
counted (``failed``, ``sync_failed``): the ring keeps serving what it has, and this gateway's own
answers are in it already. The stream holds the questions as asked (their context too), whatever
``logging.log_prompts`` says, for as long as Redis keeps them: the fleet's memory is the prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import numpy as np
import orjson
import structlog

from gateway.state.buffered import Buffered
from gateway.state.stores import RedisStore, StoreDown
from policies.cascade import Question
from policies.memory import Memory

log = structlog.get_logger("triage.state")
CHUNK = 200  # entries read at once (each about 2 kB: one read well within the store's timeout)


def encode(embedding: np.ndarray, q: Question, answer: str, origin: str) -> dict[str, bytes]:
    """A stream entry's fields: the question and its answer as JSON, the embedding as float32 bytes."""
    doc = {
        "type": q.type,
        "question": q.question,
        "options": list(q.options),
        "context": q.context,
        "task": q.task,
        "scale": list(q.scale) if q.scale is not None else None,
        "answer": answer,
    }
    vector = np.asarray(embedding, dtype=np.float32).ravel()
    return {"q": orjson.dumps(doc), "v": vector.tobytes(), "o": origin.encode()}


def decode(fields: dict[bytes, bytes]) -> tuple[np.ndarray, Question, str, str]:
    """An entry's embedding, question, answer and origin; ValueError (or KeyError, TypeError) when it
    is not one this module wrote."""
    doc = orjson.loads(fields[b"q"])
    scale = doc.get("scale")
    q = Question(
        type=doc["type"],
        question=str(doc["question"]),
        options=tuple(str(o) for o in doc["options"]),
        context=doc.get("context"),
        task=doc.get("task"),
        scale=(int(scale[0]), int(scale[1])) if scale else None,
    )
    raw = fields[b"v"]
    if len(raw) % 4:
        raise ValueError("an embedding that is no whole number of float32 values")
    return np.frombuffer(raw, dtype=np.float32), q, str(doc["answer"]), fields.get(b"o", b"").decode()


class MemoryFeed(Buffered[dict[str, bytes]]):
    def __init__(
        self, store: RedisStore, memory: Memory, layers: int, flush_s: float = 0.2, sync_s: float = 1.0
    ) -> None:
        super().__init__(flush_s, "memory-feed")
        self.store, self.memory, self.sync_s = store, memory, sync_s
        self.key = store.key("memory", f"layers-{layers}")
        self.origin = uuid.uuid4().hex  # this feed's own entries come back in its reads: skipped
        self._sync_task: asyncio.Task[int] | None = None
        self._last_id = b"0"  # the last entry read (0: none yet, the whole stream next)
        self._synced_at = -float("inf")  # monotonic
        self.written = 0  # entries written by this gateway
        self.read = 0  # other gateways' entries added to this ring
        self.skipped = 0  # entries that did not parse or fit this ring
        self.failed = 0  # entries not written because a write failed
        self.sync_failed = 0  # reads that failed
        self._down = {"write": False, "read": False}  # the last call of each failed (logged once per outage)

    def push(self, embedding: np.ndarray, q: Question, answer: str) -> None:
        """Share an answer this gateway remembered (its own ring has it already); never waits."""
        self.buffer(encode(embedding, q, answer, self.origin))

    def freshen(self) -> None:
        """Start a read of the other gateways' answers, unless one ran within ``sync_s``; never waits."""
        if self._sync_task is not None or time.monotonic() - self._synced_at < self.sync_s:
            return
        self._sync_task = asyncio.get_running_loop().create_task(self.sync(), name="memory-sync")
        self._sync_task.add_done_callback(self._synced)

    def _synced(self, task: asyncio.Task[int]) -> None:
        self._sync_task = None
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("memory_read_failed", error=repr(exc)[:300])  # not a StoreDown: unexpected

    async def sync(self) -> int:
        """Add what the stream holds after the last entry read; the entries added."""
        self._synced_at = time.monotonic()
        added = 0
        while True:
            try:
                got = await self.store.run(self.store.redis.xread({self.key: self._last_id}, count=CHUNK))
            except StoreDown as exc:
                self.sync_failed += 1
                self._failed("read", exc)
                return added
            self._back("read")
            entries = got[0][1] if got else []
            for entry_id, fields in entries:
                self._last_id = entry_id
                added += self._add(fields)
            if len(entries) < CHUNK:
                return added

    def _add(self, fields: dict[bytes, bytes]) -> int:
        try:
            embedding, q, answer, origin = decode(fields)
            if origin == self.origin:
                return 0
            self.memory.add(embedding, q, answer)
        except (ValueError, KeyError, TypeError, IndexError, orjson.JSONDecodeError):
            self.skipped += 1
            return 0
        self.read += 1
        return 1

    async def write(self, batch: list[dict[str, bytes]]) -> None:
        pipe = self.store.redis.pipeline(transaction=False)  # one round trip
        for fields in batch:
            pipe.xadd(self.key, fields, maxlen=self.memory.size, approximate=True)
        try:
            await self.store.run(pipe.execute())
        except StoreDown as exc:
            self.failed += len(batch)
            self._failed("write", exc, dropped=len(batch))
            return
        self._back("write")
        self.written += len(batch)

    def _failed(self, what: str, exc: StoreDown, **more: Any) -> None:
        if not self._down[what]:
            log.warning(f"memory_{what}_failed", error=exc.message, **more)
        self._down[what] = True

    def _back(self, what: str) -> None:
        if self._down[what]:
            log.info(f"memory_{what}_back", failed=self.failed, sync_failed=self.sync_failed)
        self._down[what] = False

    async def close(self) -> None:
        """What is buffered written (at most one round), then the read stopped (before the store closes)."""
        await self.flushed()
        task = self._sync_task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
