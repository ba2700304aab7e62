"""The Batch API across a fleet (issue 18, item 5): a real PostgreSQL server on a loopback port,
three `triage serve` processes sharing it and one batches folder, the official client; one
gateway SIGKILLed mid-batch, and every custom_id in the output exactly once; runners claiming
at once; the store down at start and mid-run; cancel from another gateway; a prefix group's replica
the same on every gateway. The store's semantics, on SQLite and PostgreSQL alike: tests/batch/test_batch_contract.py."""

from __future__ import annotations

import asyncio
import io
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import openai
import pytest

from gateway.batch.lines import plan_rows
from gateway.state.batches.model import Row
from tests.batch.test_batches import jsonl, line, wait_batch
from tests.conftest import Gateway, free_port, wait_http
from tests.servers import PgServer


def fetch(dsn: str, query: str, *args: Any) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetch(query, *args)
        finally:
            await conn.close()

    return asyncio.run(run())


# --- gateways ------------------------------------------------------------------------------------------------


@dataclass
class Proc:
    proc: subprocess.Popen
    url: str
    log: Path


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[str, int], list[Proc]]]:
    """``start(policy_yaml, n)``: n `triage serve` processes on one policy file, started at once."""
    procs: list[Proc] = []

    def start(text: str, n: int) -> list[Proc]:
        path = tmp_path / f"policy-{len(procs)}.yaml"
        path.write_text(text)
        started = []
        for _ in range(n):
            port = free_port()
            log = tmp_path / f"gateway-{port}.log"
            cmd = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(path), "--port", str(port)]
            with log.open("wb") as out:
                proc = subprocess.Popen([*cmd, "--no-watch"], stdout=out, stderr=subprocess.STDOUT)
            started.append(Proc(proc, f"http://127.0.0.1:{port}", log))
        procs.extend(started)
        for p in started:
            try:
                wait_http(f"{p.url}/health", 120, p.proc)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}: {p.log.read_text()[-3000:]}") from None
        return started

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.proc.terminate()
    for p in procs:
        p.proc.wait(20)


def fleet_policy(dsn: str, folder: Path, latency: float = 0.1, concurrency: int = 2, lease: float = 2.0) -> str:
    return f"""version: 1
backends: {{slow: {{type: scripted, text: ok, latency_s: {latency}}}}}
models: {{m: {{backend: slow}}}}
batches: {{dir: "{folder}", concurrency: {concurrency}, lease_s: {lease}, poll_s: 0.2, claim_max_requests: 16}}
state: {{database: "{dsn}"}}
"""


TEMPLATES = 10


def prefixed_lines(n: int, seed: int) -> list[str]:
    """n chat lines over TEMPLATES shared few-shot prefixes (long enough to group), in a seeded order."""
    lines = []
    for i in range(n):
        t = i % TEMPLATES
        prefix = f"Template {t}: " + " ".join(f"example-{t}-{k} means answer-{t}-{k}." for k in range(12))
        lines.append(line(f"req-{i:04d}", f"{prefix} Now question {i}?", model="m"))
    random.Random(seed).shuffle(lines)
    return lines


def victim_holds(dsn: str, pid: int) -> list[tuple[str, int]]:
    """Groups the gateway with this pid holds (its lease, not yet taken over), with requests still pending."""
    rows = fetch(
        dsn,
        "SELECT g.batch_id, g.grp FROM triage_batch_groups g WHERE g.lease_owner LIKE $1"
        " AND EXISTS (SELECT 1 FROM triage_batch_requests r"
        " WHERE r.batch_id = g.batch_id AND r.grp = g.grp AND r.state = 'pending')",
        f"%/{pid}/%",
    )
    return [(r[0], r[1]) for r in rows]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_gateway_killed_mid_batch_loses_and_repeats_nothing(
    database: str, serve: Callable[[str, int], list[Proc]], tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    gws = serve(fleet_policy(database, tmp_path / "shared"), 3)
    victim = gws[rng.randrange(3)]
    survivor = next(g for g in gws if g is not victim)
    total = 300
    upload = openai.OpenAI(base_url=f"{gws[0].url}/v1", api_key="none", max_retries=0)
    create = openai.OpenAI(base_url=f"{gws[1].url}/v1", api_key="none", max_retries=0)
    client = openai.OpenAI(base_url=f"{survivor.url}/v1", api_key="none", max_retries=0)
    try:
        data = "\n".join(prefixed_lines(total, seed)).encode()
        f = upload.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = create.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        kill_at = int(total * rng.uniform(0.15, 0.6))  # the moment, by requests done
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the victim never held a group past the kill moment"
            done = client.batches.retrieve(batch.id).request_counts
            if done is not None and done.completed >= kill_at:
                victim.proc.send_signal(signal.SIGSTOP)  # frozen: what it holds now, it holds when killed
                if victim_holds(database, victim.proc.pid):
                    break
                victim.proc.send_signal(signal.SIGCONT)  # between groups: let it claim the next one
            time.sleep(0.02)
        victim.proc.send_signal(signal.SIGKILL)  # no clean shutdown: its leases run out
        victim.proc.wait(10)
        orphaned = victim_holds(database, victim.proc.pid)  # what it held, frozen: nobody renews it now
        assert orphaned
        started = time.monotonic()
        finished = wait_batch(client, batch.id, timeout=90)
        assert finished.status == "completed", finished
        counts = finished.request_counts
        assert counts is not None and (counts.total, counts.completed, counts.failed) == (total, total, 0)
        assert finished.error_file_id is None
        out = jsonl(client, finished.output_file_id)
        ids = [o["custom_id"] for o in out]
        assert len(ids) == total and sorted(ids) == [f"req-{i:04d}" for i in range(total)]  # 0 lost, 0 twice
        assert all(o["response"]["status_code"] == 200 for o in out)
        # what the victim held was taken over by another gateway (claimed again), and finished
        claims = {
            (r[0], r[1]): (r[2], r[3])
            for r in fetch(database, "SELECT batch_id, grp, claims, state FROM triage_batch_groups")
        }
        assert all(claims[k][0] >= 2 and claims[k][1] == "done" for k in orphaned), (orphaned, claims)
        groups = len(claims)
        assert groups >= TEMPLATES  # grouped by prefix: 10 templates of 30, in parts of at most 16
        took = time.monotonic() - started
        print(f"seed {seed}: killed at {kill_at}/{total} done, {len(orphaned)} group(s) taken over, rest {took:.1f}s")
    finally:
        for c in (upload, create, client):
            c.close()


def test_postgresql_down_at_start_stops_the_gateway_naming_it(tmp_path: Path) -> None:
    port = free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(fleet_policy(f"postgresql://triage:hunter2-secret@127.0.0.1:{port}/jobs", tmp_path / "shared"))
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy), "--port", str(free_port())]
    done = subprocess.run([*cmd, "--no-watch"], capture_output=True, text=True, timeout=60)
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert f"postgresql at 127.0.0.1:{port}/jobs" in said and "state.database" in said, said[-3000:]
    assert "hunter2-secret" not in said


def test_a_batch_store_that_fails_mid_run_answers_503_and_the_batch_still_completes(
    pg: PgServer, database: str, gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    folder = tmp_path / "shared"
    gw = gateway(fleet_policy(database, folder, latency=0.2, concurrency=2, lease=1.0))
    client = gw.client()
    data = "\n".join(line(f"r{i}", f"prompt {i}", model="m") for i in range(60)).encode()
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_batch(client, batch.id, ("in_progress",))
    name = database.rsplit("/", 1)[1]
    pg.sql(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
    pg.sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
    try:
        with gw.http() as http:
            got = http.get(f"/v1/batches/{batch.id}")
            assert got.status_code == 503, got.text
            err = got.json()["error"]
            assert err["code"] == "state_store_unavailable" and err["type"] == "server_error"
            assert f"postgresql at 127.0.0.1:{pg.port}/{name}" in err["message"]
            up = http.post("/v1/files", files={"file": ("x.jsonl", b"{}")}, data={"purpose": "batch"})
            assert up.status_code == 503, up.text
        with pytest.raises(openai.InternalServerError):
            client.batches.list()
        # nothing half-written: the refused upload left no bytes beside the input file's
        assert sorted(p.name for p in (folder / "files").iterdir()) == [f.id]
        time.sleep(1.5)  # the runner meets the outage too (its writes fail; it keeps trying)
    finally:
        pg.sql(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
    done = wait_batch(client, batch.id, timeout=60)
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 60
    assert sorted(o["custom_id"] for o in jsonl(client, done.output_file_id)) == sorted(f"r{i}" for i in range(60))


def test_cancel_on_one_gateway_stops_every_gateway(
    database: str, gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    text = fleet_policy(database, tmp_path / "shared", latency=0.2, concurrency=2).replace(
        "claim_max_requests: 16", "claim_max_requests: 2"
    )
    a, b = gateway(text), gateway(text)
    data = "\n".join(line(f"c{i}", f"prompt {i}", model="m") for i in range(40)).encode()
    f = a.client().files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = a.client().batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while completed(a.client(), batch.id) < 6 or len(holders(database)) < 2:  # both gateways at work on it
        assert time.monotonic() < deadline, holders(database)
        time.sleep(0.05)
    cancelling = b.client().batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    done = wait_batch(a.client(), batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts is not None and 6 <= counts.completed < 40 and counts.failed == 0
    out = [o["custom_id"] for o in jsonl(a.client(), done.output_file_id)]
    assert len(out) == len(set(out)) == counts.completed
    time.sleep(0.6)  # nothing lands after the end: the output and the counts stay as they are
    assert fetch(database, "SELECT count(*) FROM triage_batch_requests WHERE state = 'done'")[0][0] == counts.completed
    assert b.client().batches.retrieve(batch.id).status == "cancelled"
    assert holders(database) == set()  # every group given up


def completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return 0 if counts is None else counts.completed


def holders(dsn: str) -> set[str]:
    """The runners holding a group now."""
    return {r[0] for r in fetch(dsn, "SELECT lease_owner FROM triage_batch_groups WHERE lease_owner IS NOT NULL")}


def test_keys_own_their_files_and_batches_across_gateways(
    database: str, gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    import hashlib

    keys = "\n".join(
        f'  - {{name: {n}, sha256: "{hashlib.sha256(k.encode()).hexdigest()}"}}'
        for n, k in (("alice", "sk-alice"), ("bob", "sk-bob"), ("ops", "sk-ops"))
    )
    text = (
        fleet_policy(database, tmp_path / "shared", latency=0.01) + f"keys:\n{keys}\naccess: {{operator_keys: [ops]}}\n"
    )
    a, b = gateway(text), gateway(text)
    alice, bob, ops = a.client("sk-alice"), b.client("sk-bob"), b.client("sk-ops")
    f = alice.files.create(file=("in.jsonl", io.BytesIO(line("x", "hi", model="m").encode())), purpose="batch")
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (
        lambda: bob.files.retrieve(f.id),
        lambda: bob.files.content(f.id),
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: bob.files.delete(f.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert bob.batches.list().data == []
    assert [x.id for x in ops.batches.list().data] == [batch.id]  # an operator sees every key's
    done = wait_batch(b.client("sk-alice"), batch.id)  # the owner, on the other gateway
    assert done.status == "completed"
    assert jsonl(b.client("sk-alice"), done.output_file_id)[0]["custom_id"] == "x"
    with pytest.raises(openai.NotFoundError):
        bob.files.content(done.output_file_id or "")


# --- the store's semantics: on both engines in tests/batch/test_batch_contract.py; here, runners on PostgreSQL ---


def test_two_gateways_at_once_claim_each_group_once(database: str, tmp_path: Path) -> None:
    """Many runners claiming at the same moment (SKIP LOCKED): every group goes to exactly one."""
    from gateway.state.batches.pg import PgBatches

    async def go() -> list[tuple[str, int]]:
        stores = [await PgBatches.open(database, tmp_path) for _ in range(4)]
        try:
            await stores[0].add_batch({"id": "b", "status": "validating", "created_at": 0, "endpoint": "e"})
            assert await stores[0].claim_validation("b", "v", 60)
            rows = [Row(i, f"c{i}", {}, None, i, i, None) for i in range(40)]
            assert await stores[0].start_batch("b", "v", rows, 40, {"status": "in_progress"})

            async def runner(store: PgBatches, name: str) -> list[tuple[str, int]]:
                got = []
                while (claim := await store.claim_group(name, 60)) is not None:
                    got.append((claim.batch_id, claim.grp))
                return got

            results = await asyncio.gather(*(runner(s, f"r{i}") for i, s in enumerate(stores) for _ in range(2)))
            return [k for r in results for k in r]
        finally:
            for s in stores:
                await s.close()

    claimed = asyncio.run(go())
    assert sorted(claimed) == [("b", i) for i in range(40)]


# --- one group, one replica, whichever gateway sends it --------------------------------------------------------


def test_a_prefix_group_goes_to_one_replica_from_every_gateway(tmp_path: Path) -> None:
    from backends.prefix import approx_tokens
    from gateway.service import assemble
    from gateway.service.runtime import RuntimeHolder
    from policies import loader

    text = """version: 1
backends:
  pool:
    type: openai
    replicas: [{api_base: "http://10.0.0.1:8000/v1"}, {api_base: "http://10.0.0.2:8000/v1"}, {api_base: "http://10.0.0.3:8000/v1"}]
    health: {enabled: false}
models: {m: {backend: pool}}
"""
    prompts = [f"Shared prefix number {t} " + "word " * 30 + f"question {i}" for t in range(8) for i in range(40)]
    rows = [
        Row(i, f"c{i}", {"model": "m", "messages": [{"role": "user", "content": p}]}, None)
        for i, p in enumerate(prompts)
    ]
    planned, parts = plan_rows(
        "batch_x", rows, [approx_tokens(p) for p in prompts], min_shared=16, order="none", claim_max=16
    )
    assert parts == 8 * 3  # each prefix group of 40 in parts of 16, 16 and 8
    by_part: dict[int, set[str | None]] = {}
    for r in planned:
        by_part.setdefault(r.grp or 0, set()).add(r.affinity)
    assert all(len(keys) == 1 for keys in by_part.values())  # a part has one key: its group's
    keys = sorted({r.affinity or "" for r in planned})
    assert len(keys) == 8

    async def picks() -> list[list[str]]:
        policy = loader.parse(text, "fleet.yaml", tmp_path)
        holders = [RuntimeHolder(await assemble.build(policy, base_dir=tmp_path)) for _ in range(2)]  # two gateways
        try:
            return [[h.current.backends["pool"].replicas.pick(set(), key).api_base for key in keys] for h in holders]
        finally:
            for h in holders:
                await h.close()

    first, second = asyncio.run(picks())
    assert first == second  # the same group, the same replica, on both
    assert len(set(first)) > 1  # and the groups spread over the replicas


# --- the policy field ------------------------------------------------------------------------------------------


def test_state_database_is_a_postgresql_url_or_an_env_reference() -> None:
    from pydantic import ValidationError

    from policies.schema import BatchSettings, StateSpec

    assert StateSpec(database="postgresql://u:p@db:5432/triage").database
    assert StateSpec(database="env:TRIAGE_DATABASE").database == "env:TRIAGE_DATABASE"
    with pytest.raises(ValidationError):
        StateSpec(database="mysql://db/triage")
    assert BatchSettings().lease_s == 30.0 and BatchSettings().poll_s == 1.0


def test_a_database_named_by_an_unset_variable_stops_the_start(tmp_path: Path) -> None:
    from gateway.state.batches import open_batches
    from gateway.state.stores import StoreDown
    from policies.schema import StateSpec

    with pytest.raises(StoreDown, match="TRIAGE_TEST_NO_SUCH_DB"):
        asyncio.run(open_batches(StateSpec(database="env:TRIAGE_TEST_NO_SUCH_DB"), tmp_path))


def test_a_nul_character_is_a_clear_error_on_postgresql(
    database: str, gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    """PostgreSQL keeps no NUL in text: an id holding one is a 400, a line whose custom_id holds
    one is that line's error, and the rest of the batch runs (SQLite answers the same)."""
    gw = gateway(fleet_policy(database, tmp_path / "shared", latency=0.0))
    client = gw.client()
    with gw.http() as http:
        for path in ("/v1/files/a%00b", "/v1/batches/a%00b", "/v1/batches?after=a%00b"):
            r = http.get(path)
            assert r.status_code in (400, 404) and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)
    rows = [line("good", "hi", model="m"), line("bad\u0000id", "hi", model="m")]
    f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(rows).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(client, batch.id, timeout=60)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    assert done.error_file_id is not None
    assert "NUL" in client.files.content(done.error_file_id).text
