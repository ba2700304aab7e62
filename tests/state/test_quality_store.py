"""The live-traffic quality store's contract (``gateway.state.quality.QualityStore``): one
suite, the same assertions for both engines, SQLite (``gateway/state/quality/sqlite.py``) and
PostgreSQL (``gateway/state/quality/pg.py``, on a real server: the ``database`` fixture, skipped
where PostgreSQL is not installed), each opened by ``open_quality`` as the gateway opens it. What
only one engine has (SQLite's file and folder) is tested after the contract."""

from __future__ import annotations

import asyncio
import hashlib
import os
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.state.quality import Pair, QualityStore, Record, SliceCounts, SqliteQuality, open_quality
from gateway.state.stores import StoreDown
from policies.schema import StateSpec
from tests import store_contract
from tests.servers import free_port
from tests.store_contract import engines

ALICE = hashlib.sha256(b"sk-alice").hexdigest()  # owners are the caller keys' sha256
BOB = hashlib.sha256(b"sk-bob").hexdigest()


async def _sqlite(folder: Path) -> QualityStore:
    return await open_quality(StateSpec(), folder / "state" / "quality.sqlite3")  # its folder made by the store


async def _pg(dsn: str, folder: Path) -> QualityStore:
    return await open_quality(StateSpec(database=dsn), folder / "state" / "quality.sqlite3")


engine = engines(_sqlite, _pg)
Engine = store_contract.Engine[QualityStore]


def cascade(
    request_id: str, at: float, tier: str, top: bool, slice_: str, cost: float, owner: str | None = ALICE
) -> Record:
    return Record(request_id, at, owner, "triage-qa", "cascade", tier, top, slice_, cost, f"question {request_id}?")


def routed(request_id: str, at: float, chosen: str, top: bool, cost: float, owner: str | None = ALICE) -> Record:
    return Record(request_id, at, owner, "triage-auto", "routed", chosen, top, "", cost)


def summary(
    model: str,
    kind: str,
    answered_by: str,
    top: bool,
    slice_: str,
    records: int,
    cost: float,
    *,
    pairs: int = 0,
    agree: int = 0,
    right: int = 0,
    wrong: int = 0,
    scored: int = 0,
    score_sum: float = 0.0,
    shadow_cost: float = 0.0,
) -> SliceCounts:
    return SliceCounts(
        model, kind, answered_by, top, slice_, records, pairs, agree, right, wrong, scored, score_sum, shadow_cost, cost
    )


# --- records and pairs ------------------------------------------------------------------------------------------


def test_records_and_pairs_are_kept_once_and_summed_by_slice(engine: Engine) -> None:
    async def go(store: QualityStore) -> None:
        await store.record(
            [
                cascade("r1", 100.0, "small", False, "choice", 0.25),
                cascade("r2", 101.0, "small", False, "choice", 0.5),
                cascade("r3", 102.0, "small", False, "yes_no", 0.125),
                cascade("r4", 103.0, "large", True, "choice", 2.0),
                routed("r5", 104.0, "gpt-4o-mini", False, 0.75),
                cascade("r0", 50.0, "small", False, "choice", 9.0),  # before the window below
            ]
        )
        # recorded again (another gateway, a retry): the first stays, also within one call
        await store.record([cascade("r1", 200.0, "large", True, "score", 7.0), routed("r5", 1.0, "x", True, 1.0)])
        await store.record([])
        await store.pair(Pair("r1", 110.0, "B", "B", True, 0.5))
        await store.pair(Pair("r1", 111.0, "B", "C", False, 9.0))  # one pair per request: ignored
        await store.pair(Pair("r2", 112.0, "A", "C", False, 0.5))
        await store.pair(Pair("r5", 113.0, "Paris.", "Paris", True, 1.5))
        assert await store.counts(100.0) == [
            summary("triage-auto", "routed", "gpt-4o-mini", False, "", 1, 0.75, pairs=1, agree=1, shadow_cost=1.5),
            summary("triage-qa", "cascade", "large", True, "choice", 1, 2.0),
            summary("triage-qa", "cascade", "small", False, "choice", 2, 0.75, pairs=2, agree=1, shadow_cost=1.0),
            summary("triage-qa", "cascade", "small", False, "yes_no", 1, 0.125),
        ]
        assert [(c.slice, c.records, c.cost) for c in await store.counts(0.0) if c.answered_by == "small"] == [
            ("choice", 3, 9.75),
            ("yes_no", 1, 0.125),
        ]
        assert await store.counts(104.0) == [
            summary("triage-auto", "routed", "gpt-4o-mini", False, "", 1, 0.75, pairs=1, agree=1, shadow_cost=1.5)
        ]
        assert await store.counts(104.5) == []

    engine.check(go)


# --- feedback ---------------------------------------------------------------------------------------------------


def test_feedback_lands_only_on_its_owners_records_and_the_latest_replaces_the_earlier(engine: Engine) -> None:
    async def go(store: QualityStore) -> None:
        await store.record(
            [
                cascade("a", 100.0, "small", False, "choice", 1.0, owner=ALICE),
                cascade("b", 101.0, "small", False, "choice", 1.0, owner=BOB),
                cascade("n", 102.0, "small", False, "choice", 1.0, owner=None),  # a gateway without keys
            ]
        )
        assert await store.feedback("a", ALICE, 120.0, "wrong", None)
        assert not await store.feedback("a", BOB, 121.0, "right", 1.0)  # not Bob's: nothing written
        assert not await store.feedback("nope", ALICE, 121.0, "right", None)
        assert not await store.feedback("n", ALICE, 121.0, "right", None)  # a keyed caller: its own records only
        assert await store.feedback("b", None, 122.0, None, 0.25)  # no keys: any record
        assert await store.feedback("n", None, 123.0, "right", None)
        (row,) = await store.counts(0.0)
        assert (row.records, row.right, row.wrong, row.scored, row.score_sum) == (3, 1, 1, 1, 0.25)
        assert await store.feedback("a", ALICE, 130.0, "right", 0.75)  # again: replaces the first
        assert await store.feedback("b", BOB, 131.0, "wrong", None)  # the score given before is gone too
        (row,) = await store.counts(0.0)
        assert (row.records, row.right, row.wrong, row.scored, row.score_sum) == (3, 2, 1, 1, 0.75)
        assert {(r["request_id"], r["verdict"], r["score"]) for r in await store.export(0.0, 10)} == {
            ("a", "right", 0.75),
            ("b", "wrong", None),
            ("n", "right", None),
        }

    engine.check(go)


# --- export and prune -------------------------------------------------------------------------------------------


def test_export_gives_the_checked_requests_newest_first(engine: Engine) -> None:
    async def go(store: QualityStore) -> None:
        await store.record(
            [
                cascade("old", 90.0, "small", False, "choice", 0.25),
                cascade("paired", 100.0, "small", False, "choice", 0.25),
                cascade("judged", 101.0, "large", True, "score", 2.0),
                cascade("both", 102.0, "small", False, "yes_no", 0.5),
                routed("plain", 103.0, "gpt-4o-mini", False, 0.75),  # neither pair nor feedback: not exported
            ]
        )
        await store.pair(Pair("old", 91.0, "A", "A", True, 0.5))
        await store.pair(Pair("paired", 105.0, "B", "B", True, 0.5))
        await store.pair(Pair("both", 106.0, "yes", "no", False, 0.5))
        assert await store.feedback("judged", ALICE, 107.0, None, 0.5)
        assert await store.feedback("both", ALICE, 108.0, "wrong", 0.0)
        rows = await store.export(100.0, 10)
        assert [r["request_id"] for r in rows] == ["both", "judged", "paired"]
        assert rows[0] == {
            "request_id": "both",
            "at": 102.0,
            "owner": ALICE,
            "model": "triage-qa",
            "kind": "cascade",
            "answered_by": "small",
            "top": False,
            "slice": "yes_no",
            "cost": 0.5,
            "prompt": "question both?",
            "kept": "yes",
            "top_answer": "no",
            "agree": False,
            "verdict": "wrong",
            "score": 0.0,
        }
        judged = rows[1]
        assert (judged["top"], judged["kept"], judged["top_answer"], judged["agree"]) == (True, None, None, None)
        assert (judged["verdict"], judged["score"]) == (None, 0.5)
        assert rows[2]["agree"] is True and rows[2]["verdict"] is None
        assert [r["request_id"] for r in await store.export(0.0, 2)] == ["both", "judged"]
        assert [r["request_id"] for r in await store.export(0.0, 10)][-1] == "old"

    engine.check(go)


def test_prune_forgets_old_records_with_their_pairs_and_feedback(engine: Engine) -> None:
    async def go(store: QualityStore) -> None:
        await store.record([cascade(f"o{i}", 10.0 + i, "small", False, "choice", 1.0) for i in range(3)])
        await store.record([cascade("new", 100.0, "small", False, "choice", 1.0)])
        await store.pair(Pair("o0", 500.0, "A", "A", True, 0.5))  # its pair is recent: goes with its record
        assert await store.feedback("o1", ALICE, 500.0, "right", None)
        await store.pair(Pair("new", 101.0, "A", "B", False, 0.5))
        await store.pair(Pair("lost", 20.0, "A", "B", False, 0.5))  # its record never written
        assert await store.prune(100.0) == 3
        assert await store.prune(100.0) == 0
        assert await store.counts(0.0) == [
            summary("triage-qa", "cascade", "small", False, "choice", 1, 1.0, pairs=1, shadow_cost=0.5)
        ]
        assert [r["request_id"] for r in await store.export(0.0, 10)] == ["new"]
        assert not await store.feedback("o1", ALICE, 501.0, "right", None)  # its record is gone
        await store.record([cascade("o0", 10.0, "small", False, "choice", 1.0)])  # recorded again: its pair is gone
        assert [(c.records, c.pairs) for c in await store.counts(0.0)] == [(2, 1)]
        assert [r["request_id"] for r in await store.export(0.0, 10)] == ["new"]

    engine.check(go)


# --- several writers, odd text, failures ------------------------------------------------------------------------


def test_two_stores_on_one_database_both_write(engine: Engine) -> None:
    """Two stores at once (two gateway processes: on SQLite, two connections to one file), each
    writing many times while the other does; each sees what the other wrote."""

    async def go() -> None:
        one, two = await engine.open(), await engine.open()
        try:

            async def writes(store: QualityStore, name: str) -> None:
                for i in range(20):
                    await store.record([cascade(f"{name}{i}", 100.0 + i, name, False, "choice", 0.5)])
                    await store.pair(Pair(f"{name}{i}", 200.0 + i, "A", "A", i % 2 == 0, 0.25))

            await asyncio.gather(writes(one, "x"), writes(two, "y"))
            assert await two.feedback("x3", ALICE, 300.0, "right", None)
            for store in (one, two):
                counts = await store.counts(0.0)
                assert [(c.answered_by, c.records, c.pairs, c.agree, c.right) for c in counts] == [
                    ("x", 20, 20, 10, 1),
                    ("y", 20, 20, 10, 0),
                ]
        finally:
            await one.close()
            await two.close()
        again = await engine.open()  # what they wrote is kept
        try:
            assert sum(c.records for c in await again.counts(0.0)) == 40
        finally:
            await again.close()

    asyncio.run(go())


def test_text_is_kept_without_nul_characters(engine: Engine) -> None:
    """PostgreSQL's text holds no NUL: both engines keep the text without it rather than fail."""

    async def go(store: QualityStore) -> None:
        await store.record([replace(cascade("r", 100.0, "small", False, "choice", 1.0), prompt="a\x00b")])
        await store.pair(Pair("r", 101.0, "x\x00", "\x00y", False, 0.5))
        (row,) = await store.export(0.0, 10)
        assert (row["prompt"], row["kept"], row["top_answer"]) == ("ab", "x", "y")
        assert not await store.feedback("r\x00", ALICE, 102.0, "right", None)  # no record holds a NUL
        assert not await store.feedback("r", ALICE + "\x00", 102.0, "right", None)

    engine.check(go)


def test_a_store_that_cannot_answer_is_store_down_naming_it(engine: Engine) -> None:
    engine.check_down(
        "the quality store",
        lambda store: store.counts(0.0),
        lambda store: store.record([cascade("r", 1.0, "small", False, "choice", 1.0)]),
    )


# --- SQLite's file, PostgreSQL's server -------------------------------------------------------------------------


def test_sqlite_where_the_file_cannot_be_made_is_store_down(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "plain").write_text("not a folder")
    for path in (tmp_path / "folder", tmp_path / "plain" / "quality.sqlite3"):
        with pytest.raises(StoreDown, match=r"the quality store \(sqlite at .* cannot be opened"):
            asyncio.run(open_quality(StateSpec(), path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes any file: nothing is read-only to it")
def test_sqlite_in_a_read_only_file_is_store_down(tmp_path: Path) -> None:
    path = tmp_path / "quality.sqlite3"
    path.write_bytes(b"")
    path.chmod(0o444)
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(StoreDown, match="cannot be opened"):
            asyncio.run(SqliteQuality.open(path))
    finally:
        tmp_path.chmod(0o755)


def test_postgresql_unreachable_or_unnamed_is_store_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()  # nothing listens there
    spec = StateSpec(database=f"postgresql://triage:secret@127.0.0.1:{port}/quality")
    with pytest.raises(StoreDown, match=rf"the quality store \(postgresql at 127\.0\.0\.1:{port}/quality\)") as caught:
        asyncio.run(open_quality(spec, tmp_path / "q.sqlite3"))
    assert "secret" not in str(caught.value)
    monkeypatch.delenv("TRIAGE_TEST_NO_SUCH_DB", raising=False)
    with pytest.raises(StoreDown, match="TRIAGE_TEST_NO_SUCH_DB"):
        asyncio.run(open_quality(StateSpec(database="env:TRIAGE_TEST_NO_SUCH_DB"), tmp_path / "q.sqlite3"))
    assert not (tmp_path / "q.sqlite3").exists()  # PostgreSQL named: no SQLite file made
