"""Hardening, round three (issue 51), the gateway's own bookkeeping: the console's ring bounded by
bytes (prompts kept as a prefix, a process's memory flat under large bodies), fed only by
authenticated requests and keyed per key; the response cache keyed by the key's secret and by the
values of numbers; `triage doctor` running `triage serve`'s own start checks; a batch stopped at
its key's budget; an ``x-request-id`` on every answer, errors too; feedback scores checked. Real
uvicorn, the official client and raw HTTP, scripted backends."""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from gateway.cli import app as cli
from gateway.cli import doctor as doctor_cli
from gateway.cli.policy_arg import start_problems
from gateway.http.app import _Edge
from gateway.obs.recent import Recent, Seen, weight
from policies import loader
from policies import response_cache as rules
from tests.conftest import Gateway

ADMIN = "sk-admin-h3"
ALICE, BOB = "sk-alice-h3", "sk-bob-h3"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy(extra: str = "", keys: bool = True, log_prompts: bool = False, more_keys: str = "") -> str:
    listed = (
        f"""keys:
  - {{name: alice, sha256: "{sha(ALICE)}"}}
  - {{name: bob, sha256: "{sha(BOB)}"}}
{more_keys}"""
        if keys
        else ""
    )
    return f"""version: 1
backends:
  say: {{type: scripted, text: "fine thanks"}}
models:
  m: {{backend: say, prices: {{input_per_mtok: 1000, output_per_mtok: 2000}}}}
{listed}logging: {{log_prompts: {str(log_prompts).lower()}}}
{extra}"""


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def ring(gw: Gateway) -> Recent:
    return gw.app.state.triage.metrics.recent  # type: ignore[attr-defined,no-any-return]


def rss_mb() -> float:
    for row in Path("/proc/self/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# -- the console's ring: bounded by bytes, prompts as a prefix ------------------------------------------------


def seen(rid: str, prompt: Any = None, key: str | None = "alice", show: bool = True, model: str = "m") -> Seen:
    return Seen(rid, time.time(), "chat", model, "m", 200, 1.0, key=key, prompt=prompt, show=show)


def test_the_ring_counts_its_bytes_and_keeps_prompts_as_a_prefix() -> None:
    recent = Recent(size=1000, max_bytes=2**20, prompt_chars=1000)
    big = "x" * 100_000
    for i in range(50):
        recent.add(seen(f"r{i}", [{"role": "user", "content": big}]))
        assert recent.bytes <= recent.max_bytes
    kept = recent.all()
    assert recent.bytes == sum(weight(s) for s in kept)  # the accounting matches what is held
    assert kept[-1].request_id == "r49" and len(kept) == 50  # prefixes are small: every one fits
    prompt = kept[-1].prompt
    assert isinstance(prompt, str) and prompt.startswith('[{"role":"user","content":"xxx')
    assert len(prompt) < 1100 and "more characters not kept" in prompt
    # without the prefix bound, the byte bound alone holds: the oldest leave first
    recent.bound(1000, 2**20, 2**20)
    for i in range(50, 80):
        recent.add(seen(f"r{i}", big))
    assert recent.bytes <= 2**20 and recent.all()[-1].request_id == "r79"
    assert len(recent.all()) < 12  # about 100 KB each
    # a prompt is kept only where it may be shown; a client's model name or id is clipped
    recent.add(seen("hidden", big, show=False, model="y" * 100_000))
    hidden = recent.find("hidden", "alice")
    assert hidden is not None and hidden.prompt is None and hidden.model is not None and len(hidden.model) < 300
    assert weight(hidden) < 2000


def test_large_bodies_with_log_prompts_leave_the_process_memory_flat(gateway: Callable[..., Gateway]) -> None:
    """Issue 51: with log_prompts the ring kept every prompt whole (RSS 216 -> 1,678 MB from one key)."""
    gw = gateway(policy("limits: {max_body_bytes: 4194304}\n", keys=False, log_prompts=True))
    with gw.http() as http:

        def send(i: int) -> None:
            content = f"{i:06d}" + "y" * (1_000_000 - 6)  # each prompt its own string
            r = http.post(
                "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": content}]}
            )
            assert r.status_code == 200, r.text

        for i in range(10):  # the allocator's own working set, first
            send(i)
        before = rss_mb()
        for i in range(10, 130):  # 120 MB of prompts: the ring held all of it before
            send(i)
        grown = rss_mb() - before
    recent = ring(gw)
    assert len(recent.all()) == 130 and recent.bytes < 130 * 8000, recent.bytes
    assert grown < 40, f"RSS grew {grown:.0f} MB over 120 requests of 1 MB"
    newest = recent.latest(1)[0]
    assert newest.prompt is not None and newest.prompt.startswith('[{"role":"user","content":"000129yyy')


def test_keyless_requests_keep_nothing_and_ids_are_per_key(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with gw.http() as http:
        assert http.post("/v1/chat/completions", json=body, headers={**auth(ALICE), "x-request-id": "same"}).is_success
        for i in range(30):  # no key, a wrong key: refused, and not in the ring
            r = http.post("/v1/chat/completions", json=body, headers={"x-request-id": f"anon-{i}"})
            assert r.status_code == 401
            r = http.post("/v1/chat/completions", json=body, headers={**auth("sk-guess"), "x-request-id": "same"})
            assert r.status_code == 401
        # bob sends alice's id: both kept, each under its key
        assert http.post("/v1/chat/completions", json=body, headers={**auth(BOB), "x-request-id": "same"}).is_success
    recent = ring(gw)
    assert [(s.key, s.request_id) for s in recent.all()] == [("alice", "same"), ("bob", "same")]
    alice, bob = recent.find("same", "alice"), recent.find("same", "bob")
    assert alice is not None and bob is not None and alice is not bob
    assert recent.find("same") is bob and recent.keys_of("same") == ["bob", "alice"]
    assert recent.find("same", "carol") is None


def test_the_console_shows_each_keys_request_of_a_shared_id(
    gateway: Callable[..., Gateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.http import console_auth
    from tests.http import test_console

    monkeypatch.setenv(console_auth.SECRET_ENV, "console-test-secret")
    console_auth.secret.cache_clear()
    gw = gateway(policy(f'access: {{admin_key: "{sha(test_console.ADMIN)}"}}\n'))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with gw.http() as http:
        for key in (ALICE, BOB):
            assert http.post(
                "/v1/chat/completions", json=body, headers={**auth(key), "x-request-id": "twice"}
            ).is_success
    with test_console.logged_in(gw) as console:
        newest = console.get("/console/requests/twice").text
        assert "<dd>bob</dd>" in newest and 'href="/console/requests/twice?key=alice"' in newest
        alices = console.get("/console/requests/twice?key=alice").text
        assert "<dd>alice</dd>" in alices and 'href="/console/requests/twice?key=bob"' in alices
        assert console.get("/console/requests/twice?key=carol").status_code == 404
        listing = console.get("/console/requests").text
        assert (
            'href="/console/requests/twice?key=alice"' in listing
            and 'href="/console/requests/twice?key=bob"' in listing
        )
    console_auth.secret.cache_clear()


# -- the response cache: the key's secret, numbers by value ----------------------------------------------------


def test_numbers_are_keyed_by_their_value() -> None:
    def key(body: dict[str, Any]) -> str:
        return rules.key("v", "*", "chat", {"model": "m", "messages": [{"role": "user", "content": "0.0"}], **body})

    assert key({"temperature": 0}) == key({"temperature": 0.0}) == key({"temperature": -0.0})
    assert key({"top_p": 1, "max_tokens": 5}) == key({"top_p": 1.0, "max_tokens": 5.0})
    nested = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"maximum": 10}}}}
    nested_float = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"maximum": 10.0}}}}
    assert key(nested) == key(nested_float)
    assert key({"temperature": 0}) != key({"temperature": 0.5}) != key({"temperature": 0.05})
    assert key({"seed": True}) != key({"seed": 1})  # a boolean is not a number here
    # text is text: "0.0" and "0" in a message are two prompts
    a = rules.key("v", "*", "chat", {"messages": [{"role": "user", "content": "0.0"}]})
    b = rules.key("v", "*", "chat", {"messages": [{"role": "user", "content": "0"}]})
    assert a != b
    assert rules.normal([1e300, 2.5, float(2**60)]) == [1e300, 2.5, float(2**60)]  # no integer past 2**53


def test_a_key_made_again_under_its_name_starts_with_an_empty_cache(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(f'access: {{admin_key: "{sha(ADMIN)}"}}\nresponse_cache: {{ttl_s: 600}}\n', keys=False))

    def make() -> str:
        r = httpx.post(gw.base_url + "/admin/keys", json={"name": "app"}, headers=auth(ADMIN), timeout=30)
        assert r.status_code == 201, r.text
        return str(r.json()["key"])

    def ask(key: str, temperature: float) -> str:
        body = {"model": "m", "messages": [{"role": "user", "content": "cached?"}], "temperature": temperature}
        r = httpx.post(gw.base_url + "/v1/chat/completions", json=body, headers=auth(key), timeout=30)
        assert r.status_code == 200, r.text
        return r.headers["x-triage-cache"]

    first = make()
    assert ask(first, 0) == "miss" and ask(first, 0.0) == "hit"  # 0 and 0.0: one entry
    assert httpx.delete(gw.base_url + "/admin/keys/app", headers=auth(ADMIN), timeout=30).is_success
    time.sleep(0.6)  # the keyring's cache of the key (ttl 0.5 s)
    second = make()
    assert ask(second, 0.0) == "miss"  # the same name, a new secret: not the revoked key's answers
    assert ask(second, 0) == "hit"


# -- doctor runs serve's start checks -------------------------------------------------------------------------


def test_doctor_and_serve_refuse_the_same_unset_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("H3_UNSET_KEY", "H3_UNSET_ADMIN", "H3_NOT_HEX"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "p.yaml"
    path.write_text(
        policy(keys=False)
        + 'keys:\n  - {name: a, sha256: "env:H3_UNSET_KEY"}\naccess: {admin_key: "env:H3_UNSET_ADMIN"}\n'
    )
    loaded = loader.load(path)
    problems = start_problems(path, loaded)
    assert len(problems) == 2 and all("is not set" in p for p in problems), problems
    assert any("H3_UNSET_KEY" in p for p in problems) and any("H3_UNSET_ADMIN" in p for p in problems)
    rows = doctor_cli.start_checks(path, loaded, 1)
    assert [r.detail for r in rows] == problems and {r.status for r in rows} == {doctor_cli.FAIL}
    served = CliRunner().invoke(cli, ["serve", "--policy", str(path), "--no-watch"])
    assert served.exit_code == 2 and all(p in served.output for p in problems), served.output
    # set, but not a sha256: refused at start by both, before any engine starts
    monkeypatch.setenv("H3_UNSET_KEY", "not-a-hash")
    monkeypatch.setenv("H3_UNSET_ADMIN", sha("x"))
    problems = start_problems(path, loaded)
    assert problems == ["keys[0].sha256: env:H3_UNSET_KEY does not hold a hex sha256"]
    assert [r.detail for r in doctor_cli.start_checks(path, loaded, 1)] == problems
    # limits a worker would keep alone: with --workers, as serve says
    monkeypatch.setenv("H3_UNSET_KEY", sha("y"))
    assert start_problems(path, loaded) == []
    assert doctor_cli.start_checks(path, loaded, 1)[0].status == doctor_cli.OK
    many = start_problems(path, loaded, workers=2)
    assert len(many) == 1 and "--workers 2" in many[0]
    assert [r.detail for r in doctor_cli.start_checks(path, loaded, 2)] == many


# -- a batch stops at its key's budget -------------------------------------------------------------------------


def test_a_batch_stops_at_its_keys_budget(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    from tests.batch.test_batches import jsonl, line, wait_batch

    extra = f'access: {{admin_key: "{sha(ADMIN)}"}}\nbatches: {{dir: "{tmp_path / "b"}", concurrency: 1}}\n'
    gw = gateway(policy(extra))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(gw.base_url + "/v1/chat/completions", json=body, headers=auth(ALICE), timeout=30)
    each = float(r.headers["x-triage-cost"])
    assert each > 0
    made = httpx.post(
        gw.base_url + "/admin/keys",
        json={"name": "thrifty", "limits": {"budget_per_day": 2.5 * each}},
        headers=auth(ADMIN),
        timeout=30,
    ).json()["key"]
    client = gw.client(made)
    rows = "\n".join(line(f"r{i}", "hi", model="m") for i in range(10)).encode()
    f = client.files.create(file=("in.jsonl", io.BytesIO(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(client, batch.id, timeout=60)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 7)  # 3 lines spend 3 x 2.5 / 3
    errors = jsonl(client, done.error_file_id)
    assert [e["custom_id"] for e in errors] == [f"r{i}" for i in range(3, 10)]
    for e in errors:
        assert e["response"]["status_code"] == 429 and e["error"]["code"] == "insufficient_quota"
    spent = httpx.get(gw.base_url + "/admin/spend?key=thrifty", headers=auth(ADMIN), timeout=30).json()
    assert spent["total"] == pytest.approx(3 * each)  # at most one line past the budget (concurrency 1)


# -- an x-request-id on every answer ---------------------------------------------------------------------------


def test_every_answer_carries_an_x_request_id(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(more_keys=f'  - {{name: slow, sha256: "{sha("sk-slow")}", limits: {{rpm: 1}}}}\n'))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with gw.http() as http:
        cases = [
            http.post("/v1/chat/completions", json=body),  # 401
            http.post("/v1/chat/completions", json={"model": "nope", "messages": []}, headers=auth(ALICE)),  # 4xx
            http.post("/v1/chat/completions", content=b"{not json", headers=auth(ALICE)),  # 400
            http.post("/v1/chat/completions", content=b"x" * 2_000_000, headers=auth(ALICE)),  # 413
            http.get("/v1/no-such-route"),  # 404, no route
            http.get("/v1/files/file-x/content", headers=auth(ALICE)),  # 404 of a route
            http.delete("/v1/chat/completions"),  # 405
            http.post("/v1/files", headers=auth(ALICE)),  # 400 (no form)
            http.get("/health"),
        ]
        http.post("/v1/chat/completions", json=body, headers=auth("sk-slow"))
        cases.append(http.post("/v1/chat/completions", json=body, headers=auth("sk-slow")))  # 429
        for r in cases:
            assert r.headers.get("x-request-id"), (r.request.method, r.request.url, r.status_code)
        assert [r.status_code for r in cases][-1] == 429
        assert {r.status_code for r in cases} >= {200, 400, 401, 404, 405, 413, 429}
        # the id the client chose is the one it gets back, an error's too, and the log's
        for headers in ({"x-request-id": "mine-1"}, {"x-request-id": "mine-1", **auth(ALICE)}):
            r = http.post("/v1/chat/completions", json={"model": "nope", "messages": []}, headers=headers)
            assert r.status_code >= 400 and r.headers["x-request-id"] == "mine-1"
        assert http.get("/v1/no-such-route", headers={"x-request-id": "mine-2"}).headers["x-request-id"] == "mine-2"
        ids = {http.get("/v1/no-such-route").headers["x-request-id"] for _ in range(3)}
        assert len(ids) == 3  # a new one each


def test_a_500_of_the_edge_carries_an_x_request_id() -> None:
    import asyncio

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("a bug")

    async def run(headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b""}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/x", "headers": headers}
        await _Edge(broken)(scope, receive, send)
        return sent

    start = asyncio.run(run([(b"x-request-id", b"abc")]))[0]
    assert start["status"] == 500 and (b"x-request-id", b"abc") in start["headers"]
    start = asyncio.run(run([]))[0]
    assert start["status"] == 500 and any(k == b"x-request-id" and v for k, v in start["headers"])


# -- feedback scores -------------------------------------------------------------------------------------------


def test_a_feedback_score_is_a_finite_number_from_0_to_1(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    gw = gateway(policy(f'quality: {{path: "{tmp_path / "q.sqlite3"}"}}\n'))
    with gw.http() as http:
        for score in (1.5, -0.1, 1e6, True, "0.5", [0.5], {"v": 1}):
            r = http.post("/v1/feedback", json={"request_id": "x", "score": score}, headers=auth(ALICE))
            assert r.status_code == 400 and r.json()["error"]["param"] == "score", (score, r.text)
            assert r.headers["x-request-id"]
        for raw in (b'{"request_id": "x", "score": 1e400}', b'{"request_id": "x", "score": NaN}'):
            r = http.post("/v1/feedback", content=raw, headers=auth(ALICE))
            assert r.status_code == 400, (raw, r.text)
        for score in (0, 0.7, 1):  # in range: then an unknown id is a 404
            r = http.post("/v1/feedback", json={"request_id": "x", "score": score}, headers=auth(ALICE))
            assert r.status_code == 404, (score, r.text)
