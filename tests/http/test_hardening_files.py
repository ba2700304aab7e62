"""Hostile and broken inputs on the Batch API and its files (issue 16, the rest in
``test_hardening.py``): a line that raises becomes its own error line and the batch completes;
files and batches belong to their key (an operator key sees all); a chunked upload over the limit
is refused while it streams; files are deleted by their owner and expire."""

from __future__ import annotations

import asyncio
import io
import json
import os
import select
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import structlog

from gateway.state.batches import BatchStore
from tests.batch.test_batches import jsonl, wait_batch
from tests.conftest import Gateway
from tests.http.test_errors import MSG
from tests.http.test_hardening import chat, explode_in, keys, nested, policy, raw_socket, read_all, still_serving

# --- 3. one bad line never loses a batch --------------------------------------------------------------------


def batch_line(cid: str, body: dict[str, Any] | str) -> str:
    text = body if isinstance(body, str) else json.dumps(body)
    return f'{{"custom_id": "{cid}", "method": "POST", "url": "/v1/chat/completions", "body": {text}}}'


def test_lines_that_raise_become_error_lines_and_the_batch_completes(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(latency=0.3, extra=f'batches: {{dir: "{tmp_path / "b"}", concurrency: 4}}\n'))
    explode_in(gw)
    client = gw.client()
    good = [
        batch_line(f"ok{i}", {"model": "scripted", "messages": [{"role": "user", "content": f"q{i}"}]})
        for i in range(10)
    ]
    bad = {
        "boom": batch_line("boom", {"model": "scripted", "messages": [{"role": "user", "content": "explode"}]}),
        "deep": batch_line("deep", json.loads(chat("scripted")) | {"metadata": "DEEP"}).replace('"DEEP"', nested(300)),
        "typed": batch_line(
            "typed", {"model": "auto", "messages": MSG, "response_format": {"type": "json_schema", "json_schema": "x"}}
        ),
    }
    lines = [*good[:1], bad["boom"], *good[1:5], bad["deep"], bad["typed"], *good[5:]]  # boom while 3 in flight
    f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    with structlog.testing.capture_logs() as logs:
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = wait_batch(client, batch.id, timeout=60)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (13, 10, 3)
    out, errors = jsonl(client, batch.output_file_id), jsonl(client, batch.error_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"ok{i}" for i in range(10))  # each once
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] == "fine thanks" for o in out)
    by_id = {e["custom_id"]: e for e in errors}
    assert sorted(by_id) == ["boom", "deep", "typed"] and len(errors) == 3
    assert by_id["boom"]["response"]["status_code"] == 500
    assert by_id["boom"]["error"]["code"] == "server_error" and "a bug" not in json.dumps(by_id["boom"])
    assert "nested more than" in by_id["deep"]["error"]["message"]
    assert by_id["typed"]["response"]["status_code"] == 400
    assert by_id["typed"]["response"]["body"]["error"]["param"] == "response_format.json_schema"
    [event] = [e for e in logs if e["event"] == "batch_request_failed"]
    assert event["batch_id"] == batch.id and event["exc_info"]


# --- 4. batch data belongs to its key -----------------------------------------------------------------------


def test_a_key_cannot_see_or_touch_another_keys_files_and_batches(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(
        policy(
            latency=0.2, extra=f'batches: {{dir: "{tmp_path / "b"}", concurrency: 1}}\n' + keys("sk-alice", "sk-bob")
        )
    )
    alice, bob = gw.client("sk-alice"), gw.client("sk-bob")
    data = "\n".join(batch_line(f"c{i}", {"model": "scripted", "messages": MSG}) for i in range(3)).encode()
    f = alice.files.create(file=("secret.jsonl", io.BytesIO(data)), purpose="batch")
    done = wait_batch(
        alice, alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
    )
    assert done.status == "completed" and done.output_file_id is not None
    running = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for file_id in (f.id, done.output_file_id):
        with pytest.raises(openai.NotFoundError):
            bob.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            bob.files.content(file_id)
    for batch_id in (done.id, running.id):
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(batch_id)
        with pytest.raises(openai.NotFoundError):
            bob.batches.cancel(batch_id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert bob.batches.list().data == []
    assert bob.batches.list(after=done.id).data == []
    mine = bob.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")  # bob's own work is his
    theirs = bob.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert [b.id for b in bob.batches.list().data] == [theirs.id]
    # the owner still sees and runs all of hers
    assert {b.id for b in alice.batches.list().data} == {done.id, running.id}
    assert len(jsonl(alice, done.output_file_id)) == 3
    assert wait_batch(alice, running.id).status == "completed"


def test_a_store_made_before_owners_opens_and_keeps_its_rows(tmp_path: Path) -> None:
    import sqlite3

    db = sqlite3.connect(tmp_path / "batches.sqlite3")
    db.executescript("""
CREATE TABLE files (id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE batches (id TEXT PRIMARY KEY, doc TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL);
INSERT INTO files VALUES ('file-old', 'batch', 'in.jsonl', 3, 0);
INSERT INTO batches VALUES ('batch_old', '{"id": "batch_old", "status": "completed"}', 'completed', 0);
""")
    db.close()

    async def go() -> None:
        store = await BatchStore.open(tmp_path)
        try:
            assert await store.file("file-old") is not None and await store.batch("batch_old") is not None  # as before
            assert await store.file("file-old", "somekey") is None and await store.batches(10, None, "somekey") == []
            await store.add_file(b"x", "new.jsonl", "batch", "somekey")
            assert await store.batches(10, None) == [{"id": "batch_old", "status": "completed"}]
        finally:
            await store.close()

    asyncio.run(go())


# --- 6. max_file_bytes on a chunked upload ------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_chunked_upload_over_the_limit_is_refused_while_it_streams(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}", max_file_bytes: 1048576}}\n'))
    s = raw_socket(gw)
    s.sendall(
        b"POST /v1/files HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: multipart/form-data; boundary=BOUNDARY\r\n\r\n"
    )
    preamble = (
        b'--BOUNDARY\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--BOUNDARY\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n"
    )
    s.sendall(b"%x\r\n%s\r\n" % (len(preamble), preamble))
    block = b"x" * 65536
    chunk = b"%x\r\n%s\r\n" % (len(block), block)
    peak, before, sent, answer = 0, rss_bytes(), 0, b""
    try:
        while sent < 300 * 2**20:  # 300 MiB offered, against a 1 MiB limit
            s.sendall(chunk)
            sent += len(block)
            if sent % 2**20 == 0:
                peak = max(peak, rss_bytes())
            if sent > 2**20 and select.select([s], [], [], 0.2)[0]:  # past the limit: has it answered?
                answer = read_all(s)
                break
    except (BrokenPipeError, ConnectionResetError):
        pass  # it hung up before its answer could be read; the size sent still tells
    finally:
        s.close()
    peak = max(peak, rss_bytes())
    assert sent < 32 * 2**20, sent  # refused early, not after buffering the upload
    assert peak - before < 10 * 2**20, (before, peak)
    assert answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower(), answer[:300]
    still_serving(gw)


def test_a_duplicated_custom_id_gets_an_error_line_without_that_id(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}"}}\n'))
    client = gw.client()
    ok = {"model": "scripted", "messages": MSG}
    lines = [
        batch_line("a", ok),
        batch_line("a", ok),  # a second a: its error line must not be read as a's result
        batch_line("b", ok),
        batch_line("c", {"model": "nope", "messages": MSG}),  # c fails ...
        batch_line("c", ok),  # ... and a second c does not run: c has one entry, its error
    ]
    f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 2, 3)
    out, errors = jsonl(client, batch.output_file_id), jsonl(client, batch.error_file_id)
    assert sorted(o["custom_id"] for o in out) == ["a", "b"]
    by_line = {e["error"]["message"].split(":")[0]: e for e in errors}
    assert by_line["line 2"]["custom_id"] is None
    assert "custom_id 'a' is used twice (first on line 1)" in by_line["line 2"]["error"]["message"]
    assert by_line["line 4"]["custom_id"] == "c"
    assert by_line["line 5"]["custom_id"] is None and "first on line 4" in by_line["line 5"]["error"]["message"]
    ids = [o["custom_id"] for o in out + errors if o["custom_id"] is not None]
    assert len(ids) == len(set(ids))  # every id has one entry


# --- 9. file deletion and expiry ----------------------------------------------------------------------------


def test_a_file_is_deleted_by_its_owner_only(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}"}}\n' + keys("sk-alice", "sk-bob")))
    alice, bob = gw.client("sk-alice"), gw.client("sk-bob")
    f = alice.files.create(file=("a.jsonl", io.BytesIO(b'{"x": 1}\n')), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        bob.files.delete(f.id)
    assert alice.files.retrieve(f.id).id == f.id  # bob's try left it there
    deleted = alice.files.delete(f.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (f.id, "file", True)
    assert not (tmp_path / "b" / "files" / f.id).exists()
    for call in (alice.files.retrieve, alice.files.content, alice.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)


def test_a_file_expires_after_its_seconds_and_the_sweeper_removes_it(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}", sweep_interval_s: 0.2, min_expires_after_s: 1}}\n'))
    client = gw.client()
    data = io.BytesIO(b'{"x": 1}\n')
    # created_at is whole seconds, so a file may expire up to a second before `seconds` have passed:
    # 3 s leaves at least 2 for the reads below on a loaded machine
    short = client.files.create(
        file=("s.jsonl", data), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3}
    )
    assert client.files.retrieve(short.id).expires_at == short.expires_at == short.created_at + 3
    kept = client.files.create(file=("k.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert kept.expires_at is None
    with structlog.testing.capture_logs() as logs:
        deadline = time.monotonic() + 15
        while (tmp_path / "b" / "files" / short.id).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not (tmp_path / "b" / "files" / short.id).exists()
    assert any(e["event"] == "files_expired" and short.id in e["files"] for e in logs)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(short.id)
    assert client.files.retrieve(kept.id).id == kept.id
    for bad in ({"anchor": "created_at", "seconds": 0}, {"anchor": "last_active_at", "seconds": 60}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after=bad)  # type: ignore[arg-type]
        assert caught.value.body["param"].startswith("expires_after")  # type: ignore[index]


def test_expires_after_shorter_than_openais_hour_is_refused_by_default(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(extra=f'batches: {{dir: "{tmp_path / "b"}"}}\n'))
    with pytest.raises(openai.BadRequestError) as caught:
        gw.client().files.create(
            file=("x.jsonl", io.BytesIO(b"{}\n")),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 60},
        )
    assert "from 3600 to 2592000" in caught.value.message
    f = gw.client().files.create(
        file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert f.expires_at == f.created_at + 3600


# --- 9. the operator key; /metrics and /openapi.json behind the key ----------------------------------------


def test_an_operator_key_sees_every_keys_files_and_batches(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    extra = f'batches: {{dir: "{tmp_path / "b"}"}}\n' + keys("sk-alice", "sk-bob", "sk-ops")
    gw = gateway(policy(extra=extra + "access: {operator_keys: [sk-ops]}\n"))
    alice, bob, ops = gw.client("sk-alice"), gw.client("sk-bob"), gw.client("sk-ops")
    data = batch_line("c0", {"model": "scripted", "messages": MSG}).encode()
    f = alice.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert ops.files.retrieve(f.id).id == f.id and ops.files.content(f.id).read() == data
    assert [b.id for b in ops.batches.list().data] == [batch.id]
    done = wait_batch(ops, batch.id)
    assert jsonl(ops, done.output_file_id)[0]["custom_id"] == "c0"
    mine = ops.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert [b.id for b in alice.batches.list().data] == [batch.id]  # the operator's own batch is its own
    assert sorted(b.id for b in ops.batches.list().data) == sorted([batch.id, mine.id])
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(f.id)  # an ordinary key still sees only its own
    assert ops.files.delete(f.id).deleted


def test_an_operator_key_must_name_a_key() -> None:
    from policies import loader
    from policies.errors import PolicyInvalid

    with pytest.raises(PolicyInvalid) as caught:
        loader.parse(policy(extra=keys("sk-alice") + "access: {operator_keys: [root]}\n"))
    assert any("access.operator_keys[0]: key 'root' is not defined in keys" in p for p in caught.value.problems)
