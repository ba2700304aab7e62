"""The admin API and `triage keys` (issue 18): keys made on one gateway are known to every gateway
sharing the real Redis; a revocation is seen everywhere within a second; rotation with a grace
period; spend read back; every bad call answered in the API's error shape."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import Gateway

ADMIN = "sk-admin-test"
MSG = [{"role": "user", "content": "hi"}]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy(state: str) -> str:
    return f"""version: 1
backends:
  say: {{type: scripted, text: "ok"}}
models:
  m: {{backend: say, prices: {{input_per_mtok: 1000, output_per_mtok: 2000}}}}
  other: {{backend: say}}
keys:
  - {{name: ops, sha256: "{sha("sk-ops")}"}}
access: {{admin_key: "{sha(ADMIN)}"}}
state: {state}
"""


def admin(url: str, method: str, path: str, body: object = None, key: str = ADMIN) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def chat(url: str, key: str, model: str = "m") -> httpx.Response:
    body = {"model": model, "messages": MSG}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def keys_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRIAGE_URL": url, "TRIAGE_ADMIN_KEY": ADMIN}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_keys_made_revoked_and_rotated_across_three_gateways(
    redis_url: str, gateways: Callable[[str, int], list[str]]
) -> None:
    urls = gateways(policy(f'{{store: redis, url: "{redis_url}", prefix: "t-admin"}}'), 3)
    made = keys_cli(urls[0], "create", "app1", "--model", "m", "--rpm", "4")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("sk-triage-")
    # every gateway knows it at once; its limits hold across them (4 a minute, exactly)
    statuses = [chat(urls[i % 3], secret).status_code for i in range(6)]
    assert statuses == [200, 200, 200, 200, 429, 429], statuses
    assert chat(urls[1], secret, "other").status_code == 403  # its models: m only

    listed = keys_cli(urls[2], "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)["data"]}
    assert rows["app1"]["source"] == "admin" and rows["app1"]["active"] and rows["app1"]["limits"] == {"rpm": 4}
    assert rows["ops"]["source"] == "policy" and secret not in listed.stdout

    spent = admin(urls[1], "GET", "/admin/spend?key=app1").json()
    assert spent["keys"][0]["key"] == "app1" and spent["total"] > 0
    assert spent["keys"][0]["days"][0]["model"] == "m"
    assert keys_cli(urls[0], "spend", "--key", "app1").returncode == 0

    # revoked through one gateway: refused by every gateway within a second
    other = admin(urls[0], "POST", "/admin/keys", {"name": "app2"}).json()["key"]
    assert chat(urls[1], other).status_code == 200 and chat(urls[2], other).status_code == 200  # both cache it
    assert keys_cli(urls[2], "revoke", "app2").returncode == 0
    revoked_at = time.monotonic()
    seen: dict[int, float] = {}
    while len(seen) < 3 and time.monotonic() - revoked_at < 3:
        for i, url in enumerate(urls):
            if i not in seen and chat(url, other).status_code == 401:
                seen[i] = time.monotonic() - revoked_at
    assert len(seen) == 3 and max(seen.values()) <= 1.0, seen
    refused = chat(urls[0], other).json()["error"]
    assert refused["code"] == "invalid_api_key" and other not in refused["message"]

    # rotated with a grace period: both work, then only the new one
    rotated = admin(urls[1], "POST", "/admin/keys/app1/rotate", {"grace_s": 1.5})
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()["key"]
    assert rotated.json()["limits"] == {"rpm": 4} and rotated.json()["models"] == ["m"]
    assert chat(urls[2], new, "other").status_code == 403  # the same models
    time.sleep(2.6)  # the grace period, and the gateways' half-second memory
    assert [chat(u, secret).status_code for u in urls] == [401, 401, 401]
    client = openai.OpenAI(base_url=f"{urls[0]}/v1", api_key=secret, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="m", messages=MSG)


def test_bad_admin_calls_get_clear_errors(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy("{store: memory}"))
    url = gw.base_url
    assert admin(url, "GET", "/admin/keys", key="sk-ops").status_code == 401  # a data key is not the admin's
    assert admin(url, "GET", "/admin/keys", key="wrong").json()["error"]["code"] == "invalid_api_key"
    cases = [
        ({"name": "has space"}, 400, "name"),
        ({"name": "x", "limits": {"rpm": 0}}, 400, "limits.rpm"),
        ({"name": "x", "models": ["nope"]}, 400, "models"),
        ({"name": "x", "colour": "red"}, 400, "colour"),
        ({"name": "ops"}, 409, "name"),  # the policy's key: changed in the policy, not here
    ]
    for body, status, param in cases:
        r = admin(url, "POST", "/admin/keys", body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)
    assert admin(url, "POST", "/admin/keys", {"name": "x"}).status_code == 201
    assert admin(url, "POST", "/admin/keys", {"name": "x"}).status_code == 409  # a live key has the name
    assert admin(url, "DELETE", "/admin/keys/nope").status_code == 404
    assert admin(url, "POST", "/admin/keys/nope/rotate").status_code == 404
    assert admin(url, "POST", "/admin/keys/x/rotate", {"grace_s": -1}).status_code == 400
    assert admin(url, "GET", "/admin/spend?from=2026-13-01").status_code == 400
    assert admin(url, "GET", "/admin/spend?from=2026-12-02&to=2026-12-01").status_code == 400
    assert admin(url, "GET", "/admin/spend").json()["object"] == "spend"
    # no key at all on the data plane: the admin API makes every request need one
    assert httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": MSG}).status_code == 401
    assert chat(url, "sk-ops").status_code == 200  # and the gateway keeps serving


def test_the_admin_api_is_off_without_an_admin_key(gateway: Callable[..., Gateway]) -> None:
    text = policy("{store: memory}").replace(f'access: {{admin_key: "{sha(ADMIN)}"}}\n', "")
    gw = gateway(text)
    r = admin(gw.base_url, "GET", "/admin/keys")
    assert r.status_code == 404 and "access.admin_key" in r.json()["error"]["message"]
    out = keys_cli(gw.base_url, "list")
    assert out.returncode == 1 and "access.admin_key" in out.stderr


def test_a_policy_key_may_not_take_a_live_admin_keys_name(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy("{store: memory}"), watch=True)
    assert admin(gw.base_url, "POST", "/admin/keys", {"name": "app"}).status_code == 201
    time.sleep(0.3)  # let the watcher start
    clash = policy("{store: memory}").replace("keys:\n", f'keys:\n  - {{name: app, sha256: "{sha("sk-other")}"}}\n')
    gw.policy_path.write_text(clash)
    deadline = time.monotonic() + 10
    rejected = 'triage_policy_reloads_total{outcome="rejected"} 1.0'
    while rejected not in admin(gw.base_url, "GET", "/metrics", key="sk-ops").text:
        assert time.monotonic() < deadline, "the reload was not rejected"
        time.sleep(0.1)
    assert chat(gw.base_url, "sk-other").status_code == 401  # the old policy still serves


def test_batch_lines_are_charged_to_the_key_that_made_the_batch(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    from tests.batch.test_batches import line, wait_batch

    text = policy("{store: memory}") + f'batches: {{dir: "{tmp_path / "batches"}"}}\n'
    gw = gateway(text)
    made = admin(gw.base_url, "POST", "/admin/keys", {"name": "batcher"}).json()["key"]
    each = float(chat(gw.base_url, made).headers["x-triage-cost"])  # one online call, the same body
    client = gw.client(made)
    rows = "\n".join(line(f"r{i}", "hi", model="m") for i in range(3)).encode()
    f = client.files.create(file=("in.jsonl", io.BytesIO(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_batch(client, batch.id, timeout=60).status == "completed"
    spent = admin(gw.base_url, "GET", "/admin/spend?key=batcher").json()
    assert spent["total"] == pytest.approx(4 * each)  # the online call and the three lines


def test_a_spent_budget_takes_no_new_batch(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    from tests.batch.test_batches import line

    gw = gateway(policy("{store: memory}") + f'batches: {{dir: "{tmp_path / "batches"}"}}\n')
    body = {"name": "thrifty", "limits": {"budget_per_day": 0.000001}}
    made = admin(gw.base_url, "POST", "/admin/keys", body).json()["key"]
    client = gw.client(made)
    f = client.files.create(file=("in.jsonl", io.BytesIO(line("r0", "hi", model="m").encode())), purpose="batch")
    assert chat(gw.base_url, made).status_code == 200  # the call that spends the budget
    with pytest.raises(openai.RateLimitError) as info:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert info.value.code == "insufficient_quota"
