"""The Batch API's store contract (``gateway.state.batches.Batches``): one suite, the same
assertions for both engines, SQLite (``gateway/state/batches/sqlite.py``) and PostgreSQL
(``gateway/state/batches/pg.py``, on a real server: the ``database`` fixture, skipped where
PostgreSQL is not installed). What only one engine has (SQLite's file lock, PostgreSQL's runners
claiming at once) is tested beside that engine's other tests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from gateway.state.batches import Batches, BatchStore
from gateway.state.batches.model import FileRow, Row
from tests import store_contract
from tests.store_contract import engines

CHAT = "/v1/chat/completions"


async def _pg(dsn: str, root: Path) -> Batches:
    from gateway.state.batches.pg import PgBatches

    return await PgBatches.open(dsn, root)


engine = engines(BatchStore.open, _pg)
Engine = store_contract.Engine[Batches]


def doc(batch_id: str, created_at: int, status: str = "validating") -> dict[str, object]:
    return {"id": batch_id, "status": status, "created_at": created_at, "endpoint": CHAT}


async def running(store: Batches, batch_id: str, rows: list[Row], groups: int, created_at: int = 0) -> None:
    """A batch validated by runner ``v`` and now in progress."""
    await store.add_batch(doc(batch_id, created_at), "alice")
    assert await store.claim_validation(batch_id, "v", 60) is not None
    assert await store.start_batch(batch_id, "v", rows, groups, {"status": "in_progress", "in_progress_at": 1})


# --- files ----------------------------------------------------------------------------------------------------


def test_files_belong_to_their_owner_and_their_bytes_go_with_them(engine: Engine) -> None:
    async def go(store: Batches) -> None:
        f = await store.add_file(b"hello", "in.jsonl", "batch", "alice")
        assert f["id"].startswith("file-") and (f["object"], f["purpose"], f["filename"]) == (
            "file",
            "batch",
            "in.jsonl",
        )
        assert (f["bytes"], f["expires_at"], f["status"]) == (5, None, "processed")
        assert store.file_path(f["id"]).read_bytes() == b"hello"
        assert await store.file(f["id"], "alice") == f and await store.file(f["id"]) == f  # None: the runner sees all
        assert await store.file(f["id"], "bob") is None and await store.file("file-none") is None
        assert not await store.delete_file(f["id"], "bob")
        assert store.file_path(f["id"]).exists()
        assert await store.delete_file(f["id"], "alice")
        assert not store.file_path(f["id"]).exists() and await store.file(f["id"]) is None
        assert not await store.delete_file(f["id"], "alice")  # once
        anyone = await store.add_file(b"x", "k.jsonl", "batch")  # no keys: no owner
        assert await store.file(anyone["id"]) == anyone and await store.file(anyone["id"], "alice") is None

    engine.check(go)


def test_an_expired_file_is_gone_and_the_sweep_removes_it_once(engine: Engine) -> None:
    async def go(store: Batches) -> None:
        gone = await store.add_file(b"old", "old.jsonl", "batch", "alice", expires_after=0)
        kept = await store.add_file(b"new", "new.jsonl", "batch", "alice", expires_after=3600)
        forever = await store.add_file(b"all", "all.jsonl", "batch", "alice")
        assert gone["expires_at"] == gone["created_at"] and kept["expires_at"] == kept["created_at"] + 3600
        assert await store.file(gone["id"]) is None  # past its expiry: absent before any sweep
        assert await store.sweep() == [gone["id"]]
        assert not store.file_path(gone["id"]).exists()
        assert await store.sweep() == []
        assert await store.file(kept["id"]) == kept and await store.file(forever["id"]) == forever

    engine.check(go)


# --- batches as the API reads them ----------------------------------------------------------------------------


def test_batches_newest_first_by_page_and_by_owner(engine: Engine) -> None:
    async def go(store: Batches) -> None:
        for i in range(5):
            await store.add_batch(doc(f"b{i}", i), "alice")
        await store.add_batch(doc("c", 2), "bob")  # the same second as b2: the id breaks the tie
        assert [d["id"] for d in await store.batches(2, None, "alice")] == ["b4", "b3"]
        assert [d["id"] for d in await store.batches(2, "b3", "alice")] == ["b2", "b1"]
        assert [d["id"] for d in await store.batches(10, "b1", "alice")] == ["b0"]
        assert await store.batches(10, "b0", "alice") == []
        assert [d["id"] for d in await store.batches(10, None)] == ["b4", "b3", "c", "b2", "b1", "b0"]
        assert [d["id"] for d in await store.batches(10, "c")] == ["b2", "b1", "b0"]
        assert [d["id"] for d in await store.batches(10, None, "bob")] == ["c"]
        assert await store.batches(10, None, "carol") == []
        assert await store.batch("b0", "alice") == doc("b0", 0) and await store.batch("b0") == doc("b0", 0)
        assert await store.batch("b0", "bob") is None and await store.batch("nope") is None
        assert [batch_id for batch_id, _ in await store.work()] == ["b0", "b1", "b2", "c", "b3", "b4"]  # oldest first

    engine.check(go)


def test_what_a_store_keeps_is_there_when_it_opens_again(engine: Engine) -> None:
    kept: dict[str, object] = {}

    async def first(store: Batches) -> None:
        kept.update(await store.add_file(b"kept", "in.jsonl", "batch", "alice"))
        await running(store, "b", [Row(1, "x", {"n": 1}, None, 0, 0, None)], 1)
        assert await store.finish_request("b", 1, True, {"custom_id": "x"})

    async def again(store: Batches) -> None:
        (batch,) = await store.batches(10, None, "alice")
        assert batch["id"] == "b" and batch["status"] == "in_progress" and batch["in_progress_at"] == 1
        assert await store.counts("b") == {"total": 1, "completed": 1, "failed": 0}
        assert await store.results("b", "done") == [json.dumps({"custom_id": "x"})]
        assert await store.file(str(kept["id"]), "alice") == kept and store.file_path(str(kept["id"])).exists()

    engine.check(first)
    engine.check(again)


# --- the runner: one validator, one claim per group, each result once, one finalizer --------------------------


def test_claims_leases_and_each_result_written_once(engine: Engine) -> None:
    async def go(store: Batches) -> None:
        await store.add_batch(doc("b0", 0), "alice")
        claim = await store.claim_validation("b0", "A", 60)
        assert claim is not None and claim.owner == "alice" and claim.doc == doc("b0", 0)
        assert await store.claim_validation("b0", "B", 60) is None  # one validator
        assert await store.renew_batch("b0", "A", 60) and not await store.renew_batch("b0", "B", 60)
        rows = [
            Row(1, "x", {"n": 1}, None, 0, 0, "b0/0"),
            Row(2, "y", {"n": 2}, None, 0, 1, "b0/0"),
            Row(3, "z", {"n": 3}, None, 1, 2, "b0/1"),
            Row(4, None, None, {"error": "line 4: not JSON"}),
        ]
        fields = {"status": "in_progress", "in_progress_at": 5}
        assert not await store.start_batch("b0", "B", rows, 2, fields)  # not B's lease: nothing written
        assert await store.counts("b0") == {"total": 0, "completed": 0, "failed": 0}
        assert await store.start_batch("b0", "A", rows, 2, fields)
        assert not await store.start_batch("b0", "A", rows, 2, fields)  # once
        assert not await store.renew_batch("b0", "A", 60)  # started: the batch's lease is given up
        assert await store.batch("b0") == doc("b0", 0) | fields
        assert await store.counts("b0") == {"total": 4, "completed": 0, "failed": 1}
        # groups: claimed in order, each by one runner; a lease that runs out is taken over
        g0 = await store.claim_group("A", 0.3)
        g1 = await store.claim_group("B", 60)
        assert g0 is not None and (g0.batch_id, g0.grp, g0.claims, g0.endpoint) == ("b0", 0, 1, CHAT)
        assert [(p.line, p.custom_id, p.body, p.affinity) for p in g0.pending] == [
            (1, "x", {"n": 1}, "b0/0"),
            (2, "y", {"n": 2}, "b0/0"),
        ]
        assert g0.owner == "alice"
        assert g1 is not None and g1.grp == 1 and [p.line for p in g1.pending] == [3]
        assert await store.claim_group("C", 60) is None  # both held
        assert await store.finish_request("b0", 1, True, {"custom_id": "x"})
        await asyncio.sleep(0.5)  # A stops renewing: its lease runs out
        taken = await store.claim_group("C", 60)
        assert taken is not None and (taken.grp, taken.claims, [p.line for p in taken.pending]) == (0, 2, [2])
        assert await store.renew_groups("A", [("b0", 0)], 60) == {}  # A learns it lost the group
        assert await store.renew_groups("C", [("b0", 0)], 60) == {("b0", 0): "in_progress"}
        assert await store.renew_groups("C", [], 60) == {}
        assert await store.finish_request("b0", 2, True, {"custom_id": "y", "by": "C"})
        assert not await store.finish_request("b0", 2, True, {"custom_id": "y", "by": "A"})  # the late writer
        await store.release_group("b0", 0, "A")  # not A's any more: no effect
        assert await store.renew_groups("C", [("b0", 0)], 60) == {("b0", 0): "in_progress"}
        await store.release_group("b0", 0, "C")
        assert await store.renew_groups("C", [("b0", 0)], 60) == {}
        assert await store.claim_finalization("b0", "D", 60, 9) is None  # z is pending
        assert await store.finish_request("b0", 3, False, {"custom_id": "z", "error": {"code": "x"}})
        await store.release_group("b0", 1, "B")
        assert await store.claim_group("D", 60) is None  # every group done
        # one finalizer; its files and the last state land together, under its lease
        fin = await store.claim_finalization("b0", "D", 60, 9)
        assert fin is not None and fin.owner == "alice"
        assert (fin.doc["status"], fin.doc["finalizing_at"], fin.doc["in_progress_at"]) == ("finalizing", 9, 5)
        assert await store.claim_finalization("b0", "E", 60, 10) is None
        assert await store.renew_batch("b0", "D", 60) and not await store.renew_batch("b0", "E", 60)
        assert not await store.finish_request("b0", 4, True, {})  # finalizing: the output never changes
        assert await store.results("b0", "done") == [
            json.dumps({"custom_id": "x"}),
            json.dumps({"custom_id": "y", "by": "C"}),
        ]
        assert [json.loads(r) for r in await store.results("b0", "error")] == [
            {"custom_id": "z", "error": {"code": "x"}},
            {"error": "line 4: not JSON"},
        ]
        assert await store.counts("b0") == {"total": 4, "completed": 2, "failed": 2}
        out = FileRow("file-out", "b0_done.jsonl", "batch_output", 10, "alice")
        assert not await store.end_batch("b0", "E", {"status": "completed"}, [out])
        assert await store.file("file-out") is None  # nothing written
        ended_fields = {"status": "completed", "completed_at": 11, "output_file_id": "file-out"}
        assert await store.end_batch("b0", "D", ended_fields, [out])
        assert not await store.end_batch("b0", "D", ended_fields, [out])  # once
        ended = await store.batch("b0", "alice")
        assert ended is not None and ended["status"] == "completed" and ended["output_file_id"] == "file-out"
        assert ended["finalizing_at"] == 9
        written = await store.file("file-out", "alice")
        assert written is not None and (written["purpose"], written["bytes"], written["expires_at"]) == (
            "batch_output",
            10,
            None,
        )
        assert await store.work() == []

    engine.check(go)


def test_a_finalizer_that_stops_is_taken_over_keeping_its_first_stamp(engine: Engine) -> None:
    async def go(store: Batches) -> None:
        await running(store, "b", [Row(1, "x", {}, None, 0, 0, None)], 1)
        assert await store.finish_request("b", 1, True, {"custom_id": "x"})
        assert await store.claim_finalization("b", "D", 0.2, 7) is not None
        assert await store.claim_finalization("b", "E", 60, 8) is None
        await asyncio.sleep(0.4)  # D's lease runs out
        taken = await store.claim_finalization("b", "E", 60, 8)
        assert taken is not None and taken.doc["finalizing_at"] == 7
        assert not await store.end_batch("b", "D", {"status": "completed"}, [])  # D lost it
        assert await store.end_batch("b", "E", {"status": "completed"}, [])

    engine.check(go)


def test_a_batch_that_fails_validation_ends_under_its_validators_lease(engine: Engine) -> None:
    async def go(store: Batches) -> None:
        await store.add_batch(doc("b", 0), "alice")
        failed = {"status": "failed", "failed_at": 3, "errors": {"object": "list", "data": []}}
        assert not await store.end_batch("b", "v", failed, [])  # nobody's lease yet
        assert await store.claim_validation("b", "v", 60) is not None
        assert await store.end_batch("b", "v", failed, [])
        assert await store.batch("b") == doc("b", 0) | failed
        assert await store.claim_validation("b", "w", 60) is None and await store.work() == []

    engine.check(go)


# --- cancel -----------------------------------------------------------------------------------------------------


def test_cancel_lands_once_and_the_batch_is_finalized_when_nothing_is_in_flight(engine: Engine) -> None:
    async def go(store: Batches) -> None:
        await store.add_batch(doc("v", 0), "alice")  # validating
        await running(store, "r", [Row(1, "x", {}, None, 0, 0, None), Row(2, "y", {}, None, 1, 1, None)], 2, 1)
        assert await store.cancel("v", "bob", 12) is None and await store.cancel("nope", None, 12) is None
        cancelled = await store.cancel("v", "alice", 12)
        assert cancelled == doc("v", 0) | {"status": "cancelling", "cancelling_at": 12}
        assert await store.cancel("v", "alice", 13) == cancelled  # once: the first stamp stays
        assert await store.claim_validation("v", "A", 60) is None  # never validated now
        held = await store.claim_group("A", 60)
        assert held is not None and held.batch_id == "r" and held.grp == 0
        assert ((await store.cancel("r", None, 14)) or {})["status"] == "cancelling"
        assert await store.claim_group("B", 60) is None  # no new group of a cancelled batch
        assert await store.renew_groups("A", [("r", 0)], 60) == {("r", 0): "cancelling"}  # A learns it
        assert await store.finish_request("r", 1, True, {"custom_id": "x"})  # what was in flight still lands
        assert await store.claim_finalization("r", "F", 60, 15) is None  # A still holds a group
        await store.release_group("r", 0, "A")
        fin = await store.claim_finalization("r", "F", 60, 15)
        assert fin is not None and (fin.doc["status"], fin.doc["cancelling_at"]) == ("finalizing", 14)
        assert not await store.finish_request("r", 2, True, {"custom_id": "y"})
        assert await store.counts("r") == {"total": 2, "completed": 1, "failed": 0}
        assert await store.work() == [("v", "cancelling"), ("r", "finalizing")]
        fin_v = await store.claim_finalization("v", "F", 60, 16)
        assert fin_v is not None and fin_v.doc["cancelling_at"] == 12
        assert await store.end_batch("r", "F", {"status": "cancelled", "cancelled_at": 17}, [])
        assert ((await store.cancel("r", "alice", 18)) or {})["status"] == "cancelled"  # ended: left as it is

    engine.check(go)


# --- failures ---------------------------------------------------------------------------------------------------


def test_a_store_that_cannot_answer_is_store_down_naming_it(engine: Engine) -> None:
    engine.check_down("the batch store", lambda store: store.batch("b"))
