"""Keys with limits, budgets and spend (issue 18, part): a real Redis server on a loopback port,
three `triage serve` processes sharing it, the official client; and the embedded memory store."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from gateway.state.stores import Check, MemoryStore, RedisStore, StoreDown, open_store
from policies.schema import StateSpec
from tests.conftest import Gateway, free_port

KEYS = {"alpha": "sk-alpha", "beta": "sk-beta", "ops": "sk-ops"}
MSG = [{"role": "user", "content": "hi"}]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy(state: str, prefix: str, rpm: int = 1000, budget: str = "", models: str = "") -> str:
    return f"""version: 1
backends:
  say: {{type: scripted, text: "ok"}}
models:
  m: {{backend: say, prices: {{input_per_mtok: 1000, output_per_mtok: 2000}}}}
  other: {{backend: say}}
keys:
  - {{name: alpha, sha256: "{sha(KEYS["alpha"])}", limits: {{rpm: {rpm}{budget}}}{models}}}
  - {{name: beta, sha256: "{sha(KEYS["beta"])}"}}
  - {{name: ops, sha256: "{sha(KEYS["ops"])}"}}
state: {state}
"""


def redis_state(url: str, prefix: str) -> str:
    return f'{{store: redis, url: "{url}", prefix: "{prefix}"}}'


def chat(url: str, key: str, model: str = "m") -> httpx.Response:
    body = {"model": model, "messages": MSG}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def test_a_rate_limit_holds_exactly_across_three_gateways(
    redis_url: str, gateways: Callable[[str, int], list[str]]
) -> None:
    urls = gateways(policy(redis_state(redis_url, "t-rpm"), "t-rpm", rpm=25), 3)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: chat(urls[i % 3], KEYS["alpha"]), range(60)))
    statuses = [r.status_code for r in got]
    assert statuses.count(200) == 25 and statuses.count(429) == 35, statuses
    refused = next(r for r in got if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and 1 <= int(refused.headers["retry-after"]) <= 60
    assert "alpha" in refused.json()["error"]["message"] and KEYS["alpha"] not in refused.text
    assert chat(urls[0], KEYS["beta"]).status_code == 200  # another key has its own (no) limit
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=f"{urls[1]}/v1", api_key=KEYS["alpha"], max_retries=0).chat.completions.create(
            model="m", messages=MSG
        )


def test_a_budget_holds_across_gateways_and_spend_is_counted(
    redis_url: str, gateways: Callable[[str, int], list[str]]
) -> None:
    # the scripted backend reports its usage: each call costs the same; the budget allows a few calls
    urls = gateways(policy(redis_state(redis_url, "t-budget"), "t-budget", budget=", budget_per_day: 0.05"), 2)
    first = chat(urls[0], KEYS["alpha"])
    assert first.status_code == 200
    each = float(first.headers["x-triage-cost"])
    assert each > 0
    calls = 1
    while (r := chat(urls[calls % 2], KEYS["alpha"])).status_code == 200:
        calls += 1
        assert calls < 1000
    assert calls == -(-0.05 // each), (calls, each)  # every call is admitted until the spend reaches the budget
    err = r.json()["error"]
    assert r.status_code == 429 and err["code"] == "insufficient_quota" and "resets at" in err["message"]
    assert r.headers["x-should-retry"] == "false" and int(r.headers["retry-after"]) >= 1
    client = openai.OpenAI(base_url=f"{urls[1]}/v1", api_key=KEYS["alpha"])  # default retries: told not to
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="m", messages=MSG)
    assert info.value.code == "insufficient_quota"
    assert chat(urls[0], KEYS["beta"], "other").headers["x-triage-cost"] == "0.00000000"  # no prices: free
    metrics = httpx.get(f"{urls[0]}/metrics", headers={"authorization": f"Bearer {KEYS['ops']}"}).text
    assert 'triage_spend_total{key="alpha",model="m"}' in metrics and KEYS["alpha"] not in metrics


def test_allowed_models_and_a_store_that_is_down(redis_url: str, gateways: Callable[..., list[str]]) -> None:
    urls = gateways(policy(redis_state(redis_url, "t-models"), "t-models", models=", models: [m]"), 1)
    assert chat(urls[0], KEYS["alpha"]).status_code == 200
    refused = chat(urls[0], KEYS["alpha"], "other")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    assert chat(urls[0], KEYS["alpha"], "nope").status_code == 404
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RuntimeError):  # a store down at start: the gateway says which and does not start
        gateways(policy(redis_state(dead, "x"), "x"), 1)
    degraded = gateways(policy(f'{{store: redis, url: "{dead}", degraded: true}}', "x"), 1)[0]
    r = chat(degraded, KEYS["alpha"])  # limited: fail closed
    assert r.status_code == 503 and r.json()["error"]["code"] == "state_store_unavailable", r.text
    assert chat(degraded, KEYS["beta"]).status_code == 200  # no limits: served
    ready = httpx.get(f"{degraded}/ready").json()
    assert ready["status"] == "degraded" and ready["state"] == {"store": "redis", "degraded": True}
    # the store comes back: within a second the gateway counts limits again, and says so
    port = int(dead.rsplit(":", 1)[1].split("/")[0])
    server = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while chat(degraded, KEYS["alpha"]).status_code != 200:
            assert time.monotonic() < deadline, "the gateway never saw the store come back"
            time.sleep(0.2)
        assert httpx.get(f"{degraded}/ready").json()["status"] == "ready"
    finally:
        server.terminate()
        server.wait(10)


def test_the_memory_store_limits_one_gateway(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy("{store: memory}", "", rpm=3))
    got = [chat(gw.base_url, KEYS["alpha"]).status_code for _ in range(5)]
    assert got == [200, 200, 200, 429, 429]


def test_store_semantics_match(redis_url: str) -> None:
    async def go(store: MemoryStore | RedisStore) -> list[object]:
        rpm = Check("k", ("2026-12-02",), rpm=2)
        admitted = [await store.check(rpm) for _ in range(3)]
        await store.record("k", "m", "2026-12-01", 0.25, 5, 60)
        await store.record("k", "m", "2026-12-01", 0.5, 7, 60)
        await store.record("k", "n", "2026-12-02", 1.0, 0, 60)
        spent = await store.spend("k", ["2026-11-30", "2026-12-01", "2026-12-02"])
        month = ("2026-12-02", "2026-12-01")
        refusals = [
            await store.check(Check("k", month, budget_day=1.0)),  # today's 1.0 reaches it
            await store.check(Check("k", month, budget_day=1.5, budget_month=1.75)),  # the month's 1.75
            await store.check(Check("k", month, tpm=12)),  # 12 tokens in the window
            await store.check(Check("k", month, budget_day=2, budget_month=2, tpm=13)),  # all pass (no rpm)
        ]
        await store.close()
        return [admitted, spent, refusals]

    mem = asyncio.run(go(MemoryStore()))
    red = asyncio.run(go(RedisStore(redis_url, "t-sem", 1.0)))
    for admitted, spent, refusals in (mem, red):
        assert admitted[:2] == [None, None] and admitted[2][:2] == ("rpm", 2.0) and 0 < admitted[2][2] <= 60  # type: ignore[index]
        assert spent == {"2026-12-01": {"m": 0.75}, "2026-12-02": {"n": 1.0}}
        assert refusals[:2] == [("day", 1.0, 0.0), ("month", 1.75, 0.0)] and refusals[3] is None
        assert refusals[2][:2] == ("tpm", 12.0) and 59 < refusals[2][2] <= 60  # type: ignore[index]

    async def down() -> None:
        await open_store(StateSpec(store="redis", url=f"redis://127.0.0.1:{free_port()}/0"))

    with pytest.raises(StoreDown, match=r"redis at 127\.0\.0\.1"):
        asyncio.run(down())
