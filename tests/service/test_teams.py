"""Teams across a fleet (issue 55, part 1): two `triage serve` processes sharing a real Redis. A
team's budget, counted from all its keys on both gateways, stops every key of the team (and only
the team's); a team made through one gateway's admin API, its rpm shared exactly by keys used on
both; spend read per team and per user with `triage keys spend`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from gateway.state.stores import Check, MemoryStore, RedisStore

ADMIN = "sk-admin-teams"
RED_APP, BLUE_APP = "sk-red-app-t", "sk-blue-app-t"
MSG = [{"role": "user", "content": "hi"}]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy(redis_url: str, prefix: str) -> str:
    return f"""version: 1
backends:
  say: {{type: scripted, text: "ok"}}
models:
  m: {{backend: say, prices: {{input_per_mtok: 1000, output_per_mtok: 2000}}}}
teams:
  red: {{limits: {{budget_per_day: 0.05}}}}
  blue: {{}}
keys:
  - {{name: red-app, sha256: "{sha(RED_APP)}", team: red, user: ada}}
  - {{name: blue-app, sha256: "{sha(BLUE_APP)}", team: blue}}
access: {{admin_key: "{sha(ADMIN)}"}}
state: {{store: redis, url: "{redis_url}", prefix: "{prefix}"}}
"""


def chat(url: str, key: str) -> httpx.Response:
    body = {"model": "m", "messages": MSG}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def admin(url: str, method: str, path: str, body: object = None) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)


def keys_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRIAGE_URL": url, "TRIAGE_ADMIN_KEY": ADMIN}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_a_team_budget_stops_all_its_keys_across_two_gateways(
    redis_url: str, gateways: Callable[[str, int], list[str]]
) -> None:
    urls = gateways(policy(redis_url, "t-team-budget"), 2)
    made = admin(urls[1], "POST", "/admin/keys", {"name": "red-2", "team": "red", "user": "bo"})
    assert made.status_code == 201, made.text
    keys = [RED_APP, made.json()["key"]]
    first = chat(urls[0], keys[0])
    assert first.status_code == 200
    each = float(first.headers["x-triage-cost"])
    calls = 1
    while (r := chat(urls[calls % 2], keys[(calls // 2) % 2])).status_code == 200:  # both keys, both gateways
        calls += 1
        assert calls < 1000
    assert calls == -(-0.05 // each), (calls, each)  # admitted until the team's spend reaches its budget
    err = r.json()["error"]
    assert r.status_code == 429 and err["code"] == "insufficient_quota" and "the team 'red'" in err["message"]
    for url in urls:  # every key of the team, on every gateway
        for key in keys:
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).chat.completions.create(
                    model="m", messages=MSG
                )
    assert chat(urls[1], BLUE_APP).status_code == 200  # another team: its own (no) budget

    out = keys_cli(urls[0], "spend", "--team", "red", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["team"]["team"] == "red" and report["total"] == pytest.approx(calls * each, rel=1e-6)
    by_key = {k["key"]: k["total"] for k in report["keys"]}
    assert set(by_key) == {"red-app", "red-2"} and sum(by_key.values()) == pytest.approx(report["total"], rel=1e-6)
    user = json.loads(keys_cli(urls[1], "spend", "--user", "bo", "--json").stdout)
    assert user["user"]["total"] == pytest.approx(by_key["red-2"], rel=1e-6) and [k["key"] for k in user["keys"]] == [
        "red-2"
    ]
    table = keys_cli(urls[1], "spend", "--team", "red")
    assert table.returncode == 0 and "team red" in table.stdout


def test_a_team_made_on_one_gateway_shares_its_rpm_exactly_on_both(
    redis_url: str, gateways: Callable[[str, int], list[str]]
) -> None:
    urls = gateways(policy(redis_url, "t-team-rpm"), 2)
    made = keys_cli(urls[1], "teams", "create", "green", "--model", "m", "--rpm", "6")
    assert made.returncode == 0, made.stderr
    secrets = [admin(urls[0], "POST", "/admin/keys", {"name": f"g{i}", "team": "green"}).json()["key"] for i in (1, 2)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: chat(urls[i % 2], secrets[(i // 2) % 2]), range(16)))
    statuses = [r.status_code for r in got]
    assert statuses.count(200) == 6 and statuses.count(429) == 10, statuses
    refused = next(r for r in got if r.status_code == 429)
    assert "the team 'green'" in refused.json()["error"]["message"] and 1 <= int(refused.headers["retry-after"]) <= 60
    listed = json.loads(keys_cli(urls[0], "teams", "list", "--json").stdout)["data"]
    assert {t["name"]: t["source"] for t in listed} == {"blue": "policy", "green": "admin", "red": "policy"}
    over = admin(urls[0], "POST", "/admin/keys", {"name": "g3", "team": "green", "limits": {"rpm": 60}})
    assert over.status_code == 400 and "over the team's limits" in over.json()["error"]["message"]
    busy = keys_cli(urls[0], "teams", "delete", "green")  # its keys are live
    assert busy.returncode == 1 and "live keys" in busy.stderr


def test_a_key_and_its_team_are_counted_both_or_neither(redis_url: str) -> None:
    """The store's check of several subjects: a refusal by the team counts nothing against the key."""

    async def go(store: MemoryStore | RedisStore) -> list[object]:
        both = (Check("k", ("2026-12-07",), rpm=5), Check("team:t", ("2026-12-07",), rpm=1))
        got: list[object] = [await store.check_all(both), await store.check_all(both)]
        got += [await store.check(Check("k", ("2026-12-07",), rpm=2)) for _ in range(2)]  # one slot left, not two
        await store.close()
        return got

    for got in (asyncio.run(go(MemoryStore())), asyncio.run(go(RedisStore(redis_url, "t-both", 1.0)))):
        assert got[0] is None and got[2] is None, got
        index, (what, used, wait) = got[1]  # type: ignore[misc]
        assert (index, what, used) == (1, "rpm", 1.0) and 0 < wait <= 60
        assert got[3][:2] == ("rpm", 2.0)  # type: ignore[index]
