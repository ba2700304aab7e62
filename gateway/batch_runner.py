"""Runs the Batch API's jobs in the background: validate the input file, then dispatch the
requests grouped by shared prefix, group by group, each group pinned to one replica.

A job's state lives in :class:`gateway.batch_store.BatchStore`; this task can stop at any point
(a restart, a crash) and pick up where the store says. Cancelling stops new requests; those in
flight finish and count.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import orjson
import structlog

from backends.base import Kind
from gateway import decide, pipeline
from gateway.batch_store import BatchStore, Pending, new_id
from gateway.runtime import RuntimeHolder
from gateway.schemas import MAX_DEPTH, check_depth
from policies.errors import InvalidRequest, PolicyInvalid, TriageError
from policies.plans import public_models
from policies.schema import Policy

log = structlog.get_logger("triage.batches")
T = TypeVar("T")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/decide")


class BatchRunner:
    def __init__(self, store: BatchStore, holder: RuntimeHolder, base_dir: Path = Path(".")) -> None:
        self.store = store
        self.holder = holder
        self.base_dir = base_dir  # the policy file's folder: relative tokenizer paths
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._cancelled: set[str] = set()
        self._writing = asyncio.Lock()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())
        self._sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Files past their ``expires_at`` (``expires_after`` at upload) removed, every
        ``batches.sweep_interval_s`` (read each round: a reload may change it)."""
        while True:
            try:
                if removed := await asyncio.to_thread(self.store.sweep):
                    log.info("files_expired", count=len(removed), files=removed[:20])
            except (OSError, sqlite3.Error) as exc:  # a disk problem: the next round tries again
                log.error("file_sweep_failed", error=str(exc))
            await asyncio.sleep(self.holder.current.policy.batches.sweep_interval_s)

    def wake(self) -> None:
        self._wake.set()

    async def cancel(self, batch_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        """Stop starting the batch's requests; it ends ``cancelled`` with what finished. A batch
        already finalizing (or done) is not cancelled: the check and the write hold the lock.
        None when ``viewer`` has no such batch (see :class:`BatchStore`)."""
        async with self._writing:
            doc = await asyncio.to_thread(self.store.batch, batch_id, viewer)
            if doc is None or doc["status"] not in ("validating", "in_progress"):
                return doc
            self._cancelled.add(batch_id)
            doc.update(status="cancelling", cancelling_at=int(time.time()))
            await asyncio.to_thread(self.store.save_batch, doc)
        self.wake()
        return doc

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._sweeper) if t is not None]
        for task in tasks:
            task.cancel()  # requests in flight stay pending: a restart runs them
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.store.close)

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            for doc in await asyncio.to_thread(self.store.active_batches):
                try:
                    await self._process(doc["id"])
                except Exception as exc:  # that job fails (a disk, the store, a bug); the others go on
                    log.error("batch_failed", batch_id=doc["id"], error=f"{type(exc).__name__}: {exc}")
                    await self._update(
                        doc["id"],
                        status="failed",
                        failed_at=int(time.time()),
                        errors=_errors([{"code": "batch_failed", "message": str(exc)}]),
                    )
            await self._wake.wait()

    async def _update(self, batch_id: str, counts: bool = False, **fields: Any) -> dict[str, Any]:
        """Read-modify-write of a batch under the lock (a progress tick must not undo a cancel);
        ``counts``: its request counts, read inside the lock too."""
        async with self._writing:
            doc = await asyncio.to_thread(self.store.batch, batch_id)
            assert doc is not None
            if counts:
                fields["request_counts"] = await asyncio.to_thread(self.store.counts, batch_id)
            doc.update(fields)
            await asyncio.to_thread(self.store.save_batch, doc)
            return doc

    async def _process(self, batch_id: str) -> None:
        doc = await asyncio.to_thread(self.store.batch, batch_id)
        if doc is None:
            return
        if doc["status"] == "cancelling":
            self._cancelled.add(batch_id)  # cancelled before a restart
        if doc["status"] == "validating":
            doc = await self._validate(doc)
        if doc["status"] == "in_progress":
            await self._run(doc)
        doc = await asyncio.to_thread(self.store.batch, batch_id)
        if doc is not None and doc["status"] in ("in_progress", "finalizing", "cancelling"):
            await self._finalize(doc)

    async def _validate(self, doc: dict[str, Any]) -> dict[str, Any]:
        rt = self.holder.current
        raw = await asyncio.to_thread(self.store.file_path(doc["input_file_id"]).read_bytes)
        rows = check_lines(raw, doc["endpoint"], set(public_models(rt.policy)), rt.policy.batches.max_requests)
        doc.update(status="in_progress", in_progress_at=int(time.time()))
        await asyncio.to_thread(self.store.add_requests, doc["id"], rows, doc)
        doc["request_counts"] = await asyncio.to_thread(self.store.counts, doc["id"])
        await asyncio.to_thread(self.store.save_batch, doc)
        return doc

    async def _run(self, doc: dict[str, Any]) -> None:
        """Dispatch the pending requests in the plan's order, ``concurrency`` in flight: each worker
        takes the next request when its last one ends (no barrier between groups), and a group's
        requests carry one affinity key, so they go to one replica."""
        from backends.prefix import Item, plan

        batch_id, endpoint = doc["id"], doc["endpoint"]
        pending = await asyncio.to_thread(self.store.pending, batch_id)
        policy = self.holder.current.policy
        settings = policy.batches
        tokens = await asyncio.to_thread(self._tokens, policy, batch_id, [p.body for p in pending])
        groups = plan(
            [Item(i, t, _decode(p.body)) for i, (t, p) in enumerate(zip(tokens, pending, strict=True))],
            min_shared=settings.min_shared_tokens,
            order=settings.order,
        )
        log.info("batch_planned", batch_id=batch_id, requests=len(pending), groups=len(groups))
        todo = [(pending[k], f"{batch_id}/{g}") for g, group in enumerate(groups) for k in group.keys]
        progress = _Progress(self, batch_id)

        async def one(item: tuple[Pending, str]) -> bool:
            if batch_id in self._cancelled:
                return False  # not started: it stays pending and out of the output
            await self._one(batch_id, endpoint, *item)
            await progress.tick()
            return True

        await in_order(todo, settings.concurrency, one)
        await progress.tick(force=True)

    def _tokens(self, policy: Policy, batch_id: str, bodies: list[dict[str, Any]]) -> list[tuple[int, ...]]:
        """The prompts' tokens for grouping (``batches.tokens``); a tokenizer the policy names that
        cannot be loaded is logged, and the batch is grouped by approx_tokens instead."""
        from backends.tokens import batch_tokens

        try:
            tokens, used = batch_tokens(policy, bodies, self.base_dir)
        except PolicyInvalid as exc:
            log.warning("batch_tokenizer_failed", batch_id=batch_id, problems=exc.problems)
            tokens, used = batch_tokens(policy, bodies, self.base_dir, tokens="approx")
        except Exception as exc:  # a tokenizer library's own failure: order by approx instead
            log.warning("batch_tokenizer_failed", batch_id=batch_id, problems=[f"{type(exc).__name__}: {exc}"])
            tokens, used = batch_tokens(policy, bodies, self.base_dir, tokens="approx")
        log.info("batch_tokens", batch_id=batch_id, tokenizers=used)
        return tokens

    async def _one(self, batch_id: str, endpoint: str, req: Pending, affinity: str) -> None:
        """One request and its result, whatever happens to it: this is the line's edge. A line
        whose handling raises anything (a bug, a body the store cannot write) is answered with its
        own error entry, so it neither fails the batch nor cancels the requests beside it."""
        rid = new_id("batch_req_")
        try:
            status, body = await self._serve(endpoint, req, rid, affinity)
            await asyncio.to_thread(
                self.store.finish_request, batch_id, req.line, status == 200, _result(rid, req.custom_id, status, body)
            )
        except Exception:  # the line's edge (see above); cancellation is not an Exception and goes on
            log.exception("batch_request_failed", batch_id=batch_id, line=req.line, request_id=rid)
            err = TriageError("The server had an error while processing this request")
            await asyncio.to_thread(
                self.store.finish_request,
                batch_id,
                req.line,
                False,
                _result(rid, req.custom_id, err.status, err.body()),
            )

    async def _serve(self, endpoint: str, req: Pending, rid: str, affinity: str) -> tuple[int, dict[str, Any]]:
        rt = self.holder.acquire()
        try:
            return await serve(rt, endpoint, dict(req.body), rid, affinity)
        finally:
            await self.holder.release(rt)

    async def _finalize(self, doc: dict[str, Any]) -> None:
        batch_id, now = doc["id"], int(time.time())
        doc = await self._update(batch_id, status="finalizing", finalizing_at=now)
        cancelled = batch_id in self._cancelled  # a cancel lands before that write, or sees "finalizing"
        fields: dict[str, Any] = {"request_counts": await asyncio.to_thread(self.store.counts, batch_id)}
        owner = await asyncio.to_thread(self.store.batch_owner, batch_id)  # its outputs are its owner's
        for state, key, purpose in (
            ("done", "output_file_id", "batch_output"),
            ("error", "error_file_id", "batch_output"),
        ):
            lines = await asyncio.to_thread(self.store.results, batch_id, state)
            if lines:
                content = ("\n".join(lines) + "\n").encode()
                f = await asyncio.to_thread(self.store.add_file, content, f"{batch_id}_{state}.jsonl", purpose, owner)
                fields[key] = f["id"]
        fields.update(
            {"status": "cancelled", "cancelled_at": now} if cancelled else {"status": "completed", "completed_at": now}
        )
        await self._update(batch_id, **fields)
        log.info("batch_finished", batch_id=batch_id, status=fields["status"], **fields["request_counts"])


async def in_order(items: Iterable[T], workers: int, fn: Callable[[T], Awaitable[bool]]) -> None:
    """``fn`` over ``items`` in their order, ``workers`` at a time: a worker takes the next item as
    soon as its last one ends (no barrier anywhere); ``fn`` returning False stops that worker."""
    todo = iter(items)  # one iterator shared by the workers: the order is kept

    async def worker() -> None:
        for item in todo:
            if not await fn(item):
                return

    try:
        async with asyncio.TaskGroup() as tg:  # one worker failing stops the others
            for _ in range(workers):
                tg.create_task(worker())
    except ExceptionGroup as group:
        raise group.exceptions[0] from None


class _Progress:
    """Writes a running batch's ``request_counts`` at most once a second."""

    def __init__(self, runner: BatchRunner, batch_id: str, every_s: float = 1.0) -> None:
        self.runner, self.batch_id, self.every_s = runner, batch_id, every_s
        self.last = time.monotonic()

    async def tick(self, force: bool = False) -> None:
        if force or time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            await self.runner._update(self.batch_id, counts=True)


def _result(rid: str, custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """One line of the output file (status 200) or of the error file."""
    result: dict[str, Any] = {
        "id": rid,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": rid, "body": body},
        "error": None,
    }
    if status != 200:
        err = body.get("error") or {}
        result["error"] = {"code": err.get("code") or err.get("type"), "message": err.get("message")}
    return result


def _decode(body: dict[str, Any]) -> int:
    """Expected decode tokens, for the order: the request's own limit, else a guess."""
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 0:
            return body[key]
    return 16


def _errors(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": items}


def check_lines(
    raw: bytes,
    endpoint: str,
    models: set[str],
    max_requests: int,
) -> list[tuple[int, str | None, dict | None, dict | None]]:
    """Every line of an input file: (line, custom_id, body) to run, or an error result for the
    error file naming the line. A malformed line never stops the others."""
    rows: list[tuple[int, str | None, dict | None, dict | None]] = []
    seen: dict[str, int] = {}  # custom_id -> the line that has it
    lines = [(n, line) for n, line in enumerate(raw.split(b"\n"), 1) if line.strip()]
    for n, line in lines:
        cid = None
        try:
            doc = orjson.loads(line)
            if not isinstance(doc, dict):
                raise InvalidRequest("the line is not a JSON object")
            cid = doc.get("custom_id") if isinstance(doc.get("custom_id"), str) else None
            if cid in seen:  # its error line carries no custom_id: the id's one result is the first line's
                first, cid = seen[cid], None
                raise InvalidRequest(f"custom_id {doc['custom_id']!r} is used twice (first on line {first})")
            if cid:
                seen[cid] = n  # taken even when this line fails: its error line is then the id's one entry
            check_depth(line, doc, MAX_DEPTH + 1)  # the body nests as deep as the API lets it
            body = _check_line(doc, endpoint, models)
            if len(rows) >= max_requests:
                raise InvalidRequest(f"over the limit of {max_requests} requests per batch")
            rows.append((n, cid, body, None))
        except (orjson.JSONDecodeError, InvalidRequest) as exc:
            message = exc.message if isinstance(exc, InvalidRequest) else f"not JSON: {exc}"
            rows.append(
                (
                    n,
                    cid,
                    None,
                    {
                        "id": new_id("batch_req_"),
                        "custom_id": cid,
                        "response": None,
                        "error": {"code": "invalid_request", "message": f"line {n}: {message}"},
                    },
                )
            )
    return rows


def _check_line(doc: dict[str, Any], endpoint: str, models: set[str]) -> dict[str, Any]:
    cid = doc.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise InvalidRequest("custom_id must be a non-empty string")
    if doc.get("method", "POST") != "POST":
        raise InvalidRequest("method must be POST")
    if doc.get("url") != endpoint:
        raise InvalidRequest(f"url {doc.get('url')!r} is not the batch's endpoint {endpoint}")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    if endpoint != "/v1/decide" and body.get("model") not in models:
        raise InvalidRequest(f"the model {body.get('model')!r} does not exist")
    if body.get("stream"):
        raise InvalidRequest("a batch request cannot stream")
    return body


async def serve(
    rt: Any,
    endpoint: str,
    body: dict[str, Any],
    request_id: str,
    affinity: str | None,
) -> tuple[int, dict[str, Any]]:
    """One batch request through the gateway's own paths; an error is a status and an OpenAI error body."""
    attempts: list[Any] = []
    try:
        if endpoint == "/v1/decide":
            q, overrides = decide.parse_one(rt, body)  # the route's checks and statuses
            return 200, decide.body(await decide.decide(rt, q, overrides, request_id, attempts), request_id)
        kind: Kind = "chat" if endpoint == "/v1/chat/completions" else "completion"
        out = await pipeline.run(rt, kind, {**body, "stream": False}, request_id, attempts, affinity)
        if out.typed is not None:
            return 200, out.typed
        assert out.served is not None and out.served.completion is not None
        return 200, out.served.completion.body
    except TriageError as exc:
        return exc.status, exc.body()
