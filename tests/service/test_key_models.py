"""A key's models hold wherever a model is chosen (issue 36): the doors that name one, the
decision routes that name none (a cascade's model tier the key may not reach is skipped, said in
the trace), every line of a batch the key made, and the decision cache (one key's decision is
never served to a key with other models). Real gateways over HTTP, scripted backends."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from tests.batch.test_batches import jsonl, wait_batch
from tests.conftest import Gateway

KEYS = {"ops": "sk-ops", "cheap": "sk-cheap", "none": "sk-none"}
YES = {"question": "Is ice cold?", "type": "yes_no"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy(tmp: Path) -> str:
    """Two model tiers: the first never confident enough to keep its answer, so the top decides;
    a key that may reach only the first has it decide alone."""
    return f"""version: 1
backends:
  small: {{type: scripted, text: "yes"}}
  large: {{type: scripted, text: "no"}}
models:
  small: {{backend: small}}
  big: {{backend: large}}
  other: {{backend: small}}
virtual_models:
  auto: {{type: cascade, open: small}}
cascade:
  cache_ttl_s: 60
  tiers:
    - {{name: cheap, type: model, model: small, assumed_confidence: 0.5, thresholds: {{yes_no: 0.9}}}}
    - {{name: top, type: model, model: big}}
keys:
  - {{name: ops, sha256: "{sha(KEYS["ops"])}"}}
  - {{name: cheap, sha256: "{sha(KEYS["cheap"])}", models: [small]}}
  - {{name: none, sha256: "{sha(KEYS["none"])}", models: [other]}}
batches: {{dir: "{tmp / "batches"}"}}
"""


def post(gw: Gateway, key: str, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{gw.base_url}{path}", json=body, headers={"authorization": f"Bearer {KEYS[key]}"}, timeout=30)


def test_a_decision_asks_only_the_tiers_the_key_may_reach(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    gw = gateway(policy(tmp_path))
    full = post(gw, "ops", "/v1/decide", YES).json()
    assert (full["tier"], full["answer"]) == ("top", "no"), full
    narrow = post(gw, "cheap", "/v1/decide", YES)
    assert narrow.status_code == 200, narrow.text
    d = narrow.json()
    assert (d["tier"], d["answer"], d["cache"]) == ("cheap", "yes", "miss"), d  # not the ops key's cached decision
    assert [(s["tier"], s["outcome"]) for s in d["trace"]] == [("cheap", "accepted"), ("top", "skipped")]
    assert d["trace"][1]["error"] == "the key 'cheap' may not use the model 'big'"
    assert post(gw, "ops", "/v1/decide", YES).json()["cache"] == "hit"  # each key's decision kept apart
    assert post(gw, "cheap", "/v1/decide", YES).json()["tier"] == "cheap"
    for path, body in (("/v1/decide", YES), ("/v1/decide/batch", [YES])):
        refused = post(gw, "none", path, body)  # a key that may reach no tier: refused at the door
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed", refused.text
    chat = {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}
    assert post(gw, "cheap", "/v1/chat/completions", chat).status_code == 403  # it may not name the cascade model


def test_a_decide_batch_answers_each_item_and_a_bad_override_is_its_own_error(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy(tmp_path))
    bad = {**YES, "policy_overrides": {"thresholds": {"nope": {"yes_no": 0.5}}}}
    r = post(gw, "cheap", "/v1/decide/batch", [YES, bad, {"question": "Is fire hot?", "type": "yes_no"}])
    assert r.status_code == 200, r.text
    first, wrong, third = r.json()
    assert first["tier"] == third["tier"] == "cheap"
    assert wrong["error"]["param"] == "policy_overrides.thresholds" and "nope" in wrong["error"]["message"]
    one = post(gw, "ops", "/v1/decide", bad)  # the route's own answer to it: the same 400
    assert one.status_code == 400 and one.json()["error"]["param"] == "policy_overrides.thresholds"


def test_every_line_of_a_batch_runs_under_its_owners_models(gateway: Callable[..., Gateway], tmp_path: Path) -> None:
    gw = gateway(policy(tmp_path))
    client = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key=KEYS["cheap"])

    def run(endpoint: str, bodies: list[dict]) -> dict[str, dict]:
        data = "\n".join(
            json.dumps({"custom_id": f"l{i}", "method": "POST", "url": endpoint, "body": b})
            for i, b in enumerate(bodies)
        )
        f = client.files.create(file=("in.jsonl", io.BytesIO(data.encode())), purpose="batch")
        created = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
        batch = wait_batch(client, created.id)
        assert batch.status == "completed", batch
        out = [o for fid in (batch.output_file_id, batch.error_file_id) if fid for o in jsonl(client, fid)]
        return {o["custom_id"]: o["response"] for o in out}

    msg = [{"role": "user", "content": "hi"}]
    chats = run("/v1/chat/completions", [{"model": m, "messages": msg} for m in ("small", "big", "auto")])
    assert chats["l0"]["status_code"] == 200
    for line in ("l1", "l2"):
        assert chats[line]["status_code"] == 403, chats[line]
        assert chats[line]["body"]["error"]["code"] == "model_not_allowed"
    decided = run("/v1/decide", [YES])["l0"]
    assert decided["status_code"] == 200 and decided["body"]["tier"] == "cheap", decided
    assert decided["body"]["trace"][1]["outcome"] == "skipped"


def test_what_a_listed_name_reaches_comes_with_it(tmp_path: Path) -> None:
    from policies import loader
    from policies.plans import reach

    path = tmp_path / "p.yaml"
    path.write_text(
        policy(tmp_path).replace("  other: {backend: small}\n", "  other: {backend: small, fallbacks: [big]}\n")
    )
    p = loader.load(path)
    assert reach(p, ["small"]) == {"small"}
    assert reach(p, ["other"]) == {"other", "big"}  # its fallback comes with it
    assert reach(p, ["auto"]) == {"auto", "small", "big"}  # a cascade model: its open route and its tiers
    assert reach(p, ["gone"]) == {"gone"}  # a store key may outlive a model: nothing more
