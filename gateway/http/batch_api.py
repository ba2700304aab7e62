"""The OpenAI Batch API: ``/v1/files`` and ``/v1/batches``, as the official client calls them.

Errors are raised: the app's one ``TriageError`` handler turns them into OpenAI-shaped bodies (a
store that fails: ``StoreDown``, 503, naming the store)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
from fastapi import APIRouter, Request, Response
from starlette.datastructures import FormData
from starlette.types import Message

from gateway.batch.runner import BatchRunner
from gateway.http.doors import read_body
from gateway.service.bodies import BatchCreate, check, parse_json
from gateway.service.keys import quotas
from gateway.state.batches import Batches
from gateway.state.batches.model import ACTIVE, new_id
from policies.errors import ClientGone, InvalidRequest, NotFound, NotReady, PayloadTooLarge, RequestTimeout
from policies.schema import ApiKey

log = structlog.get_logger("triage.batches")
router = APIRouter()
_OVERHEAD = 64 * 1024  # multipart framing and the other fields, over the file's own bytes


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


@dataclass(frozen=True)
class _Caller:
    runner: BatchRunner
    owner: str | None  # the key's sha256: what its new files and batches are kept under; None without keys
    viewer: str | None  # whose files and batches it sees: its own; None (all) without keys or for an operator key
    key: ApiKey | None = None  # the key itself (its limits), None without keys

    @property
    def store(self) -> Batches:
        return self.runner.store


async def _caller(request: Request) -> _Caller:
    """The runner, and who asks: another key's files and batches read as absent (404), as on OpenAI.
    They belong to the key's sha256: a rotated key does not see the old one's (an operator key does)."""
    state = request.app.state.triage
    rt = state.holder.current
    key = await rt.authenticate(request.headers.get("authorization"))
    if state.batches is None:
        raise NotReady("the Batch API is off: its store is held by another gateway process (see the log)")
    owner = rt.key_digest(request.headers.get("authorization")) if key is not None else None
    return _Caller(state.batches, owner, None if owner in rt.operator_hashes else owner, key)


@router.post("/v1/files")
async def upload(request: Request) -> Response:
    caller = await _caller(request)
    settings = caller.runner.holder.current.policy.batches
    limit = settings.max_file_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit + _OVERHEAD:
        raise PayloadTooLarge(f"the file is over the limit of {limit} bytes")
    wait_s = caller.runner.holder.current.policy.limits.body_timeout_s
    # the form closes the spooled upload however this ends
    async with _counted(request, limit + _OVERHEAD, wait_s).form() as form:
        purpose, upload_ = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise InvalidRequest("purpose must be 'batch'", param="purpose")
        if upload_ is None or isinstance(upload_, str):
            raise InvalidRequest("a file is required", param="file")
        expires_after = _expires_after(form, settings.min_expires_after_s)
        content = await upload_.read()
        name = upload_.filename or "input.jsonl"
    if len(content) > limit:
        raise PayloadTooLarge(f"the file is over the limit of {limit} bytes")
    return _json(await caller.store.add_file(content, name, "batch", caller.owner, expires_after))


_MAX_EXPIRES_AFTER = 2_592_000  # 30 days, as on OpenAI


def _expires_after(form: FormData, shortest: int) -> int | None:
    """OpenAI's ``expires_after`` form fields (``expires_after[anchor]``: created_at, and
    ``expires_after[seconds]``): the file's lifetime in seconds, None when not asked."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidRequest("expires_after[anchor] must be 'created_at'", param="expires_after.anchor")
    given = seconds if isinstance(seconds, str) and seconds.isascii() and seconds.isdigit() else None  # "³" is a digit
    if given is None or not shortest <= int(given) <= _MAX_EXPIRES_AFTER:
        raise InvalidRequest(
            f"expires_after[seconds] must be an integer from {shortest} to {_MAX_EXPIRES_AFTER}",
            param="expires_after.seconds",
        )
    return int(given)


def _counted(request: Request, limit: int, wait_s: float) -> Request:
    """The request with its body counted as it arrives: past ``limit`` bytes, a 413 before any
    more is read or spooled (a chunked upload has no Content-Length to refuse it by). Timed as
    every body is: a 408 after ``wait_s`` without a byte, or once the whole upload took ``wait_s``
    plus a second per MiB of ``limit`` (a trickle holds nothing for long)."""
    seen = 0
    loop = asyncio.get_running_loop()
    whole = wait_s + limit / (1 << 20)
    deadline = loop.time() + whole

    async def receive() -> Message:
        nonlocal seen
        try:
            async with asyncio.timeout_at(min(deadline, loop.time() + wait_s)):
                message = await request.receive()
        except TimeoutError:
            raise RequestTimeout(f"the upload stalled for {wait_s:g} s or took over {whole:.0f} s in all") from None
        if message["type"] == "http.disconnect":  # gone mid-upload: the client's doing, not ours (499)
            raise ClientGone("the client closed the connection before its upload was in")
        seen += len(message.get("body", b""))
        if seen > limit:
            raise PayloadTooLarge(f"the file is over the limit of {limit - _OVERHEAD} bytes")
        return message

    return Request(request.scope, receive)


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> Response:
    return _json(await _file(await _caller(request), file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    caller = await _caller(request)
    await _file(caller, file_id)
    try:
        content = await asyncio.to_thread(caller.store.file_path(file_id).read_bytes)
    except FileNotFoundError:  # the row is here, the bytes are not: a batches.dir the fleet does not share
        log.error("file_bytes_missing", file_id=file_id, path=str(caller.store.file_path(file_id)))
        raise NotReady(
            f"the bytes of {file_id} are not on this gateway's batches folder", code="file_unavailable"
        ) from None
    return Response(content, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    caller = await _caller(request)
    if not await caller.store.delete_file(file_id, caller.viewer):
        raise NotFound(f"No such file: {file_id}", param="file_id")
    return _json({"id": file_id, "object": "file", "deleted": True})


async def _file(caller: _Caller, file_id: str) -> dict[str, Any]:
    doc = await caller.store.file(file_id, caller.viewer)
    if doc is None:
        raise NotFound(f"No such file: {file_id}", param="file_id")
    return doc


@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    caller = await _caller(request)
    rt = caller.runner.holder.current
    raw = parse_json(await read_body(request, rt.policy.limits))
    body = check(BatchCreate, raw)  # a 400 naming the field; an unknown endpoint or window among them
    await quotas.check_budget(rt, caller.key)  # a spent budget takes no new batch (one running finishes)
    file_id, endpoint = body.input_file_id, body.endpoint
    f = await caller.store.file(file_id, caller.viewer)
    if f is None:
        raise NotFound(f"No such file: {file_id}", param="input_file_id")
    if f["purpose"] != "batch":
        raise InvalidRequest("the input file's purpose is not 'batch'", param="input_file_id")
    now = int(time.time())
    doc = {
        "id": new_id("batch_"),
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": file_id,
        "completion_window": "24h",
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + 86400,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": body.metadata,
    }
    await caller.store.add_batch(doc, caller.owner)
    caller.runner.wake()
    return _json(doc)


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> Response:
    caller = await _caller(request)
    doc = await caller.store.batch(batch_id, caller.viewer)
    if doc is None:
        raise NotFound(f"No such batch: {batch_id}", param="batch_id")
    return _json(await _live(caller.store, doc))


async def _live(store: Batches, doc: dict[str, Any]) -> dict[str, Any]:
    """A batch being run, with its progress request by request (whichever gateways run it)."""
    if doc["status"] in ACTIVE and doc["status"] != "validating":
        doc["request_counts"] = await store.counts(doc["id"])
    return doc


@router.get("/v1/batches")
async def list_batches(request: Request) -> Response:
    caller = await _caller(request)
    raw_limit = request.query_params.get("limit", "20")
    if not (raw_limit.isascii() and raw_limit.isdigit()) or not 1 <= int(raw_limit) <= 100:  # "³" is a digit too
        raise InvalidRequest("limit must be between 1 and 100", param="limit")
    limit, after = int(raw_limit), request.query_params.get("after")
    docs = await caller.store.batches(limit + 1, after, caller.viewer)
    page = [await _live(caller.store, doc) for doc in docs[:limit]]
    return _json(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(docs) > limit,
        }
    )


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    caller = await _caller(request)
    doc = await caller.runner.cancel(batch_id, caller.viewer)
    if doc is None:
        raise NotFound(f"No such batch: {batch_id}", param="batch_id")
    return _json(doc)
