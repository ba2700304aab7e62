"""Runs the Batch API's jobs in the background, alone or as one of a fleet of gateways sharing a store.

A job goes ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed`` (or ``cancelled``,
or ``failed``). Each runner, every ``batches.poll_s`` or when woken:

- validates a batch it claims (the batch's lease): checks the input file's lines, groups the
  requests by shared prefix and writes them, with the groups, in one transaction;
- claims prefix groups of any running batch, one at a time, each under a lease renewed while it
  works, and dispatches their requests in the plan's order, ``batches.concurrency`` in flight: a
  worker takes the next request when its last one ends (no barrier between groups), and a group's
  requests carry one affinity key, so they go to one replica, whichever gateway sends them;
- finalizes a batch it claims once no request is pending (or, cancelled, once no group is held):
  the output and error files, and the batch's last state, in one transaction.

A runner can stop at any point (a restart, SIGKILL): what it held is claimed again when its
leases run out, and a request's result is written only while the request is pending, so each
``custom_id`` appears once in the output. Cancelling stops new requests, on every gateway; those
in flight finish and count.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog

from backends.base import Kind
from gateway.batch.lines import check_lines, plan_rows
from gateway.service import decisions
from gateway.service.cache import response as response_cache
from gateway.service.context import Context
from gateway.service.keys import quotas
from gateway.service.runtime import RuntimeHolder
from gateway.service.service import Service
from gateway.state.batches import Batches
from gateway.state.batches.model import BatchClaim, FileRow, GroupClaim, Pending, new_id, output_file_id, write_bytes
from gateway.state.stores import StoreDown
from policies import spend
from policies.cascade import CascadeExhausted
from policies.errors import BudgetExhausted, PolicyInvalid, TriageError
from policies.plans import public_models
from policies.schema import ApiKey, BatchSettings, Policy

log = structlog.get_logger("triage.batches")
T = TypeVar("T")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/decide")


@dataclass(eq=False)
class _Held:
    """A group this runner holds: its requests not yet started, and those in flight."""

    claim: GroupClaim
    todo: deque[Pending]
    in_flight: int = 0
    stopped: bool = False  # start nothing more: its batch was cancelled, or the lease was lost
    lost: bool = False  # another runner holds it now: nothing to release
    released: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.claim.batch_id, self.claim.grp)


@dataclass(eq=False)
class _Drain:
    """One round of dispatch: workers take requests until no group is left to claim. A new round
    starts when the last one has ended (its last request in flight too), within ``batches.poll_s``."""

    dry: bool = False


class BatchRunner:
    def __init__(self, store: Batches, holder: RuntimeHolder, base_dir: Path = Path(".")) -> None:
        self.store = store
        self.holder = holder
        self.base_dir = base_dir  # the policy file's folder: relative tokenizer paths
        self.owner = f"{socket.gethostname()}/{os.getpid()}/{new_id('')[:8]}"  # this runner, in leases
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._drain: asyncio.Task[None] | None = None
        self._held: dict[tuple[str, int], _Held] = {}
        self._queue: deque[_Held] = deque()  # held groups with requests not yet started, in claim order
        self._claiming = asyncio.Lock()

    @property
    def settings(self) -> BatchSettings:
        return self.holder.current.policy.batches  # read each time: a reload may change them

    def start(self) -> None:
        self._tasks = [asyncio.create_task(t) for t in (self._loop(), self._sweep(), self._renew())]

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        """Stop; the requests in flight stay pending, and the groups held are given up at once
        (another gateway takes them now, not when their leases run out)."""
        tasks = [t for t in (*self._tasks, self._drain) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for held in list(self._held.values()):
            with contextlib.suppress(StoreDown):
                await self.store.release_group(held.claim.batch_id, held.claim.grp, self.owner)
        await self.store.close()

    async def cancel(self, batch_id: str, viewer: str | None = None) -> dict[str, Any] | None:
        """Stop starting the batch's requests, here and (within ``batches.poll_s``) on every
        gateway; it ends ``cancelled`` with what finished. A batch already finalizing (or ended)
        is not cancelled. None when ``viewer`` has no such batch (see ``gateway/state/batch_store.py``)."""
        doc = await self.store.cancel(batch_id, viewer, int(time.time()))
        if doc is not None and doc["status"] == "cancelling":
            for held in self._held.values():
                if held.claim.batch_id == batch_id:
                    held.stopped = True
            self.wake()
        return doc

    # --- the loop: validation, finalization, and a drain when there may be groups -----------------------------

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                for batch_id, status in await self.store.work():
                    await self._step(batch_id, status)
            except StoreDown as exc:  # the next round tries again
                log.warning("batch_store_down", error=exc.message)
            except Exception:  # the runner's edge: a bug is logged, and the next round goes on
                log.exception("batch_runner_failed")
            if self._drain is None or self._drain.done():
                if self._drain is not None and not self._drain.cancelled() and self._drain.exception() is not None:
                    log.error("batch_dispatch_failed", error=repr(self._drain.exception()))
                self._drain = asyncio.create_task(self._dispatch())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)

    async def _step(self, batch_id: str, status: str) -> None:
        lease_s = self.settings.lease_s
        if status == "validating":
            claim = await self.store.claim_validation(batch_id, self.owner, lease_s)
            job = self._validate
        else:
            claim = await self.store.claim_finalization(batch_id, self.owner, lease_s, int(time.time()))
            job = self._finalize
        if claim is None:
            return  # not ready, or another runner's
        try:
            async with self._leased(batch_id):
                await job(claim)
        except StoreDown:
            raise  # its lease runs out; a runner (maybe this one) claims it again
        except Exception as exc:  # that job fails (a disk, its input file gone, a bug); the others go on
            log.error("batch_failed", batch_id=batch_id, error=f"{type(exc).__name__}: {exc}")
            errors = {"object": "list", "data": [{"code": "batch_failed", "message": str(exc)}]}
            fields = {"status": "failed", "failed_at": int(time.time()), "errors": errors}
            await self.store.end_batch(batch_id, self.owner, fields, [])

    @contextlib.asynccontextmanager
    async def _leased(self, batch_id: str) -> AsyncIterator[None]:
        """The batch's lease renewed while the block runs (validating a big file may take a while)."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.settings.lease_s / 3)
                with contextlib.suppress(StoreDown):
                    if not await self.store.renew_batch(batch_id, self.owner, self.settings.lease_s):
                        log.warning("batch_lease_lost", batch_id=batch_id)  # its last write will not land
                        return

        task = asyncio.create_task(renew())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _validate(self, claim: BatchClaim) -> None:
        doc, policy = claim.doc, self.holder.current.policy
        batch_id, settings = doc["id"], policy.batches
        path = self.store.file_path(doc["input_file_id"])
        try:
            raw = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            log.error("batch_input_missing", batch_id=batch_id, path=str(path))
            raise RuntimeError(
                f"the input file {doc['input_file_id']} is gone (deleted, expired, or not on the folder this gateway"
                " reads: with state.database, batches.dir must be a folder every gateway shares)"
            ) from None
        rows = check_lines(raw, doc["endpoint"], set(public_models(policy)), settings.max_requests)
        runnable = [r for r in rows if r.error is None]
        tokens = await asyncio.to_thread(self._tokens, policy, batch_id, [r.body or {} for r in runnable])
        planned, groups = plan_rows(
            batch_id,
            rows,
            tokens,
            min_shared=settings.min_shared_tokens,
            order=settings.order,
            claim_max=settings.claim_max_requests,
        )
        counts = {"total": len(rows), "completed": 0, "failed": len(rows) - len(runnable)}
        fields = {
            "status": "in_progress",
            "in_progress_at": int(time.time()),
            "request_counts": counts,
            "prefix_groups": groups,  # triage's own field: the groups its requests were claimed in (the console)
        }
        if await self.store.start_batch(batch_id, self.owner, planned, groups, fields):
            log.info("batch_planned", batch_id=batch_id, requests=len(runnable), groups=groups)
        else:
            log.info("batch_validation_dropped", batch_id=batch_id)  # cancelled meanwhile, or its lease was lost

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

    async def _finalize(self, claim: BatchClaim) -> None:
        """The output and error files (bytes first, under ids fixed by the batch, so a finalizer
        that takes over writes the same files), then their rows and the last state, in one transaction."""
        batch_id, now = claim.doc["id"], int(time.time())
        fields: dict[str, Any] = {"request_counts": await self.store.counts(batch_id)}
        files = []
        for state, key in (("done", "output_file_id"), ("error", "error_file_id")):
            lines = await self.store.results(batch_id, state)
            if lines:
                content = ("\n".join(lines) + "\n").encode()
                file_id = output_file_id(batch_id, state)
                await asyncio.to_thread(write_bytes, self.store.file_path(file_id), content)
                files.append(FileRow(file_id, f"{batch_id}_{state}.jsonl", "batch_output", len(content), claim.owner))
                fields[key] = file_id
        cancelled = claim.doc.get("cancelling_at") is not None  # a cancel lands before finalizing, or not at all
        fields.update(
            {"status": "cancelled", "cancelled_at": now} if cancelled else {"status": "completed", "completed_at": now}
        )
        if await self.store.end_batch(batch_id, self.owner, fields, files):
            log.info("batch_finished", batch_id=batch_id, status=fields["status"], **fields["request_counts"])

    # --- dispatch: groups claimed and their requests run -----------------------------------------------------

    async def _dispatch(self) -> None:
        drain = _Drain()
        await in_order(lambda: self._next(drain), self.settings.concurrency, self._one)

    async def _next(self, drain: _Drain) -> tuple[_Held, Pending] | None:
        """The next request of the groups held, claiming a group when none is left; None when no
        group is left to claim (this drain ends; the loop starts another within ``batches.poll_s``)."""
        async with self._claiming:
            while True:
                while self._queue:
                    held = self._queue[0]
                    if held.stopped or not held.todo:
                        self._queue.popleft()
                        held.todo.clear()
                        await self._settle(held)
                        continue
                    held.in_flight += 1
                    return held, held.todo.popleft()
                if drain.dry:
                    return None
                try:
                    claim = await self.store.claim_group(self.owner, self.settings.lease_s)
                except StoreDown as exc:
                    log.warning("batch_store_down", error=exc.message)
                    claim = None
                if claim is None:
                    drain.dry = True
                    return None
                log.info(
                    "batch_group_claimed",
                    batch_id=claim.batch_id,
                    group=claim.grp,
                    requests=len(claim.pending),
                    takeover=claim.claims > 1,
                )
                held = _Held(claim, deque(claim.pending))
                self._held[held.key] = held
                self._queue.append(held)

    async def _settle(self, held: _Held) -> None:
        """Give the group up once nothing of it is left to start and nothing is in flight."""
        if held.released or held.in_flight or (held.todo and not held.stopped):
            return
        held.released = True
        self._held.pop(held.key, None)
        if not held.lost:
            try:
                await self.store.release_group(held.claim.batch_id, held.claim.grp, self.owner)
            except StoreDown as exc:  # its lease runs out instead
                log.warning("batch_store_down", error=exc.message)
        self.wake()  # its batch may be ready to finalize

    async def _renew(self) -> None:
        """Every held group's lease extended; one another runner took is dropped (its requests not
        started are the new holder's), one whose batch is no longer running starts nothing more."""
        while True:
            await asyncio.sleep(min(self.settings.lease_s / 3, self.settings.poll_s))
            held = [h for h in self._held.values() if not h.lost]
            if not held:
                continue
            try:
                alive = await self.store.renew_groups(self.owner, [h.key for h in held], self.settings.lease_s)
            except StoreDown as exc:
                log.warning("batch_store_down", error=exc.message)
                continue
            for h in held:
                if h.released:
                    continue  # given up while the renewal ran
                status = alive.get(h.key)
                if status is None:
                    log.warning("batch_group_lost", batch_id=h.claim.batch_id, group=h.claim.grp)
                    h.lost = h.stopped = True
                elif status != "in_progress":
                    h.stopped = True
                if h.stopped:
                    await self._settle(h)

    async def _one(self, item: tuple[_Held, Pending]) -> bool:
        """One request and its result, whatever happens to it: this is the line's edge. A line
        whose handling raises anything (a bug, a body the store cannot write) is answered with its
        own error entry, so it neither fails the batch nor cancels the requests beside it. The
        store down: the request stays pending, and the group is given up (claimed again later)."""
        held, req = item
        claim = held.claim
        rid = new_id("batch_req_")
        try:
            try:
                status, body, charges = await self._serve(claim.endpoint, req, rid, claim.owner)
                written = await self.store.finish_request(
                    claim.batch_id, req.line, status == 200, _result(rid, req.custom_id, status, body)
                )
                if written and claim.owner is not None and charges:  # charged once: for the result kept
                    await self._charge(claim.owner, charges)
            except StoreDown:
                raise
            except Exception:  # the line's edge (see above); cancellation is not an Exception and goes on
                log.exception("batch_request_failed", batch_id=claim.batch_id, line=req.line, request_id=rid)
                err = TriageError("The server had an error while processing this request")
                result = _result(rid, req.custom_id, err.status, err.body())
                written = await self.store.finish_request(claim.batch_id, req.line, False, result)
            if not written:  # another runner wrote it first (this one's lease had run out)
                log.info("batch_result_dropped", batch_id=claim.batch_id, line=req.line, request_id=rid)
        except StoreDown as exc:
            log.warning("batch_store_down", error=exc.message, batch_id=claim.batch_id, line=req.line)
            held.stopped = True
        finally:
            held.in_flight -= 1
            await self._settle(held)
        return True

    async def _serve(
        self, endpoint: str, req: Pending, rid: str, owner: str | None
    ) -> tuple[int, dict[str, Any], Charges]:
        rt = self.holder.acquire()
        try:
            key = await rt.keyring.owner(owner) if owner is not None and rt.keyring is not None else None
            return await answer_line(rt, endpoint, dict(req.body), rid, req.affinity, key)
        finally:
            await self.holder.release(rt)

    async def _charge(self, owner: str, charges: Charges) -> None:
        rt = self.holder.acquire()
        try:
            await quotas.record_owner(rt, owner, charges)
        finally:
            await self.holder.release(rt)

    async def _sweep(self) -> None:
        """Files past their ``expires_at`` (``expires_after`` at upload) removed, every
        ``batches.sweep_interval_s`` (read each round: a reload may change it)."""
        while True:
            try:
                if removed := await self.store.sweep():
                    log.info("files_expired", count=len(removed), files=removed[:20])
            except (OSError, StoreDown) as exc:  # a disk or the store: the next round tries again
                log.error("file_sweep_failed", error=str(exc))
            await asyncio.sleep(self.settings.sweep_interval_s)


async def in_order(
    items: Iterable[T] | Callable[[], Awaitable[T | None]], workers: int, fn: Callable[[T], Awaitable[bool]]
) -> None:
    """``fn`` over ``items`` in their order, ``workers`` at a time: a worker takes the next item as
    soon as its last one ends (no barrier anywhere); ``fn`` returning False stops that worker.
    ``items``: an iterable, or an async function giving the next item (None: there is no more)."""
    take = items if callable(items) else _taker(iter(items))  # one source shared by the workers: the order is kept

    async def worker() -> None:
        while (item := await take()) is not None:
            if not await fn(item):
                return

    try:
        async with asyncio.TaskGroup() as tg:  # one worker failing stops the others
            for _ in range(workers):
                tg.create_task(worker())
    except ExceptionGroup as group:
        raise group.exceptions[0] from None


def _taker(todo: Iterator[T]) -> Callable[[], Awaitable[T | None]]:
    async def take() -> T | None:
        return next(todo, None)

    return take


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


Charges = list[tuple[str, Mapping[str, Any] | None, float]]


async def answer_line(
    rt: Any,
    endpoint: str,
    body: dict[str, Any],
    request_id: str,
    affinity: str | None,
    key: ApiKey | None = None,
) -> tuple[int, dict[str, Any], Charges]:
    """One batch request through the gateway's own paths; an error is a status and an OpenAI error
    body. With it, what it cost: each model it asked at its prices (a cascade's every tier).
    ``key``: the batch's owner, whose models hold for every line (403 for a line that names another)
    and whose budget too: once it is spent, each line left is a 429 error line (lines already in
    flight, ``batches.concurrency`` at most, finish and are charged)."""
    models, service = rt.policy.models, Service(rt)
    ctx = Context(request_id, key=key, surface="batch", affinity=affinity)
    try:
        await quotas.check_budget(rt, key)  # a store that is down: the line stays pending (StoreDown goes on)
    except BudgetExhausted as exc:
        return exc.status, exc.body(), []
    try:
        if endpoint == "/v1/decide":
            plan = decisions.plan(rt, key)  # the route's checks and statuses
            q, overrides = decisions.parse(body, plan)
            d = await service.decide(q, overrides, ctx, plan)
            return 200, decisions.body(d, request_id), spend.decision_charges(models, d)
        kind: Kind = "chat" if endpoint == "/v1/chat/completions" else "completion"
        quotas.allowed(rt, key, body.get("model") if isinstance(body.get("model"), str) else None)
        out = await service.generate(kind, {**body, "stream": False}, ctx)
        if out.typed is not None:
            assert out.decision is not None
            return 200, out.typed, spend.decision_charges(models, out.decision)
        assert out.served is not None and out.served.completion is not None
        usage = out.served.completion.body.get("usage")
        usage = usage if isinstance(usage, dict) else None
        if out.cache is not None and out.cache.result == "hit":
            return 200, out.served.completion.body, [response_cache.charge(out.served.model, out.cache)]
        return 200, out.served.completion.body, [(out.served.model, usage, quotas.price(rt, out.served.model, usage))]
    except CascadeExhausted as exc:
        return exc.status, exc.body(), spend.trace_charges(models, exc.trace)
    except TriageError as exc:
        return exc.status, exc.body(), []
