"""The Batch API through the official client against a real uvicorn; a real llama.cpp server as
the pool; a gateway process killed mid-batch and started again."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from gateway.state.batches import BatchStore, StoreBusy
from tests.conftest import Gateway, LlamaServer, free_port, wait_http

FEW_SHOT = "You answer in one word.\nQ: colour of the sky? A: blue\nQ: colour of grass? A: green\nQ: "


def line(cid: str, content: str, model: str = "smollm2", url: str = "/v1/chat/completions") -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": url,
            "body": {
                "model": model,
                "max_tokens": 2,
                "temperature": 0,
                "messages": [{"role": "user", "content": content}],
            },
        }
    )


def pool_policy(api_base: str, batch_dir: Path, concurrency: int = 2) -> str:
    return f"""version: 1
backends:
  pool: {{type: openai, replicas: [{{api_base: "{api_base}"}}], health: {{enabled: false}}}}
models:
  smollm2: {{backend: pool}}
batches: {{dir: "{batch_dir}", concurrency: {concurrency}, max_file_bytes: 65536}}
"""


def wait_batch(
    client: openai.OpenAI,
    batch_id: str,
    done: tuple[str, ...] = ("completed", "failed", "cancelled"),
    timeout: float = 120,
) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in done:
            return batch
        time.sleep(0.1)
    raise TimeoutError(f"batch {batch_id} still {batch.status}")


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    assert file_id is not None
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_batch_end_to_end_with_bad_lines(
    gateway: Callable[..., Gateway], llama_server: LlamaServer, tmp_path: Path
) -> None:
    gw = gateway(pool_policy(llama_server.api_base, tmp_path / "batches"))
    client = gw.client()
    lines = [line(f"q{i}", FEW_SHOT + f"colour of thing {i}? A:") for i in range(8)]
    lines.insert(3, "{not json")
    lines.insert(5, line("ghost", "hi", model="no-such-model"))
    lines.append(line("q1", "a second q1"))
    lines.append(json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions", "body": {}}))
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"team": "qa"}
    )
    assert batch.status == "validating" and batch.metadata == {"team": "qa"}
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (12, 8, 4)
    out = jsonl(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == [f"q{i}" for i in range(8)]  # each once
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"] for o in out)
    errors = {e["error"]["message"].split(":")[0]: e for e in jsonl(client, batch.error_file_id)}
    assert set(errors) == {"line 4", "line 6", "line 11", "line 12"}
    assert errors["line 6"]["custom_id"] == "ghost" and "does not exist" in errors["line 6"]["error"]["message"]
    assert "used twice" in errors["line 11"]["error"]["message"]
    assert "not the batch's endpoint" in errors["line 12"]["error"]["message"]
    listed = client.batches.list(limit=5)
    assert [b.id for b in listed.data] == [batch.id]


def test_bad_requests_to_the_batch_api(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    gw = gateway(pool_policy("http://127.0.0.1:9/v1", tmp_path / "batches"))
    client = gw.client()
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 70000)), purpose="batch")
    assert info.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    f = client.files.create(file=("x.jsonl", io.BytesIO(line("a", "hi").encode())), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")  # type: ignore[arg-type]
    for metadata in ({"k": "a\x00b"}, {f"k{i}": "v" for i in range(17)}, {"k": "v" * 513}):  # no store keeps a NUL
        with pytest.raises(openai.BadRequestError) as bad:
            client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata=metadata
            )
        assert bad.value.param == "metadata"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with gw.http() as http:
        assert http.post("/v1/batches", content=b"{oops").status_code == 400
        assert http.get("/v1/batches", params={"limit": 0}).status_code == 400
        assert http.get("/health").status_code == 200


BAD_DECIDES = [
    {},  # no question
    {"question": "x", "type": "sideways"},
    {"question": "x", "type": "choice", "options": ["only one"]},
    {"question": "x", "type": "score"},  # a score without a scale
    {"question": "x", "type": "yes_no", "task": "no-such-task"},
    {"question": "Is it?", "type": "yes_no"},  # good: answered by the cascade, or a 404 without one
]


@pytest.mark.parametrize("with_cascade", [True, False])
def test_a_decide_line_answers_as_the_route_does(
    gateway: Callable[..., Gateway], tmp_path: Path, with_cascade: bool
) -> None:
    cascade = "cascade: {tiers: [{name: pool, type: model, model: m}]}\n" if with_cascade else ""
    gw = gateway(f"""version: 1
backends: {{say: {{type: scripted, text: "yes"}}}}
models: {{m: {{backend: say}}}}
batches: {{dir: "{tmp_path / "batches"}"}}
{cascade}""")
    with gw.http() as http:
        routed = [http.post("/v1/decide", json=body) for body in BAD_DECIDES]
    client = gw.client()
    data = "\n".join(
        json.dumps({"custom_id": f"d{i}", "method": "POST", "url": "/v1/decide", "body": body})
        for i, body in enumerate(BAD_DECIDES)
    )
    f = client.files.create(file=("in.jsonl", io.BytesIO(data.encode())), purpose="batch")
    batch = wait_batch(
        client, client.batches.create(input_file_id=f.id, endpoint="/v1/decide", completion_window="24h").id
    )
    lines = [o for f in (batch.output_file_id, batch.error_file_id) if f is not None for o in jsonl(client, f)]
    by_id = {o["custom_id"]: o["response"] for o in lines}
    for i, r in enumerate(routed):
        line_ = by_id[f"d{i}"]
        assert line_["status_code"] == r.status_code, (BAD_DECIDES[i], line_, r.text)
        if r.status_code != 200:
            assert line_["body"]["error"]["code"] == r.json()["error"]["code"]
    assert [r.status_code for r in routed][-1] == (200 if with_cascade else 404)


def test_cancel_stops_new_requests(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    gw = gateway(f"""version: 1
backends: {{slow: {{type: scripted, text: ok, latency_s: 0.3}}}}
models: {{m: {{backend: slow}}}}
batches: {{dir: "{tmp_path / "batches"}", concurrency: 1}}
""")
    client = gw.client()
    data = "\n".join(line(f"c{i}", f"prompt {i}", model="m") for i in range(20)).encode()
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_batch(client, batch.id, ("in_progress",))
    time.sleep(0.7)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    done = batch.request_counts.completed
    assert 1 <= done < 20 and batch.request_counts.failed == 0
    assert len(jsonl(client, batch.output_file_id)) == done


@pytest.mark.fleet  # a gateway process, killed and started again
def test_a_restart_mid_batch_finishes_it_with_every_request_once(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("""version: 1
backends: {slow: {type: scripted, text: ok, latency_s: 0.2}}
models: {m: {backend: slow}}
batches: {dir: batches, concurrency: 1}
""")

    def start() -> tuple[subprocess.Popen, str]:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy), "--port", str(port), "--no-watch"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/health", 60, proc)
        return proc, base

    proc, base = start()
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        data = "\n".join(line(f"r{i}", f"prompt {i}", model="m") for i in range(15)).encode()
        f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 30
        while client.batches.retrieve(batch.id).request_counts.completed < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        client.close()
        proc.send_signal(signal.SIGKILL)  # no clean shutdown
        proc.wait(10)
        proc, base = start()
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        done = wait_batch(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 15
        out = jsonl(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(15))  # each exactly once
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)


def test_one_store_one_process(tmp_path: Path) -> None:
    """SQLite's own guarantee (the rest of the store's: tests/batch/test_batch_contract.py, on both engines)."""
    import asyncio

    async def go() -> None:
        store = await BatchStore.open(tmp_path)
        with pytest.raises(StoreBusy):
            await BatchStore.open(tmp_path)
        await store.add_batch({"id": "b", "status": "validating", "created_at": 0})
        await store.close()
        again = await BatchStore.open(tmp_path)  # the lock goes with the store, the rows stay
        assert await again.batch("b") == {"id": "b", "status": "validating", "created_at": 0}
        await again.close()

    asyncio.run(go())


def test_dispatch_keeps_the_order_and_never_waits_for_a_group_to_end() -> None:
    """A slow first request holds one worker; the other takes every later request meanwhile (a
    barrier between groups would deadlock here: the slow one ends only after the last)."""
    import asyncio

    from gateway.batch.runner import in_order

    async def main() -> list[str]:
        last_done = asyncio.Event()
        started: list[str] = []

        async def fn(item: str) -> bool:
            if "stop" in started:  # as a cancel: every worker stops before its next request
                return False
            started.append(item)
            if item == "slow":
                await asyncio.wait_for(last_done.wait(), 5)
            if item == "c":
                last_done.set()
            return True

        await in_order(["slow", "a", "b", "c", "stop", "never"], 2, fn)
        return started

    assert asyncio.run(main()) == ["slow", "a", "b", "c", "stop"]


def test_a_batch_groups_by_the_models_tokenizer_or_falls_back_to_approx(
    gateway: Callable[..., Gateway], llama_server: LlamaServer, tmp_path: Path
) -> None:
    import structlog

    from classifiers.artifacts import source_dir

    (tmp_path / "tok.json").symlink_to(source_dir() / "tokenizer.json")  # a real tokenizer.json (MiniLM's)
    (tmp_path / "broken.json").write_text("{not json")  # there (a missing file is a policy problem), unreadable
    lines = "\n".join(line(f"q{i}", FEW_SHOT + f"colour of thing {i}? A:") for i in range(4)).encode()
    for tokenizer, event, used in (
        ("tok.json", "batch_tokens", "smollm2=json:tok.json"),
        ("broken.json", "batch_tokenizer_failed", None),
    ):
        policy = pool_policy(llama_server.api_base, tmp_path / f"batches-{tokenizer}").replace(
            "smollm2: {backend: pool}", f"smollm2: {{backend: pool, tokenizer: {tokenizer}}}"
        )
        gw = gateway(policy)
        client = gw.client()
        with structlog.testing.capture_logs() as logs:
            uploaded = client.files.create(file=("in.jsonl", io.BytesIO(lines)), purpose="batch")
            batch = client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            batch = wait_batch(client, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 4
        [hit] = [e for e in logs if e["event"] == event]
        if used is not None:
            assert hit["tokenizers"] == used
        else:
            assert "broken.json" in hit["problems"][0]
            [fallback] = [e for e in logs if e["event"] == "batch_tokens"]
            assert fallback["tokenizers"] == "smollm2=approx"
