"""The exact decision cache (issue 18): a typed decision kept in the state store under the policy's
version; a hit asks no tier, costs nothing and says so; it survives a gateway restart on a real
Redis and is bypassed after a reload. And a cascade's spend: every model tier it asked, priced."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from tests.conftest import Gateway

QUESTION = {"question": "Pick one.", "type": "choice", "options": ["x", "y", "z"]}


def policy(state: str, threshold: float = 0.7, ttl: str = "cache_ttl_s: 600") -> str:
    # the first tier's assumed confidence (0.6) is under its threshold: every question goes on to the
    # second, slow one (0.3 s); both are priced
    return f"""version: 1
backends:
  cheap: {{type: scripted, text: "B"}}
  dear: {{type: scripted, text: "B", latency_s: 0.3}}
models:
  cheap: {{backend: cheap, prices: {{input_per_mtok: 1000, output_per_mtok: 1000}}}}
  dear: {{backend: dear, prices: {{input_per_mtok: 10000, output_per_mtok: 10000}}}}
cascade:
  {ttl}
  tiers:
    - {{name: first, type: model, model: cheap, logprobs: false, assumed_confidence: 0.6,
       thresholds: {{choice: {threshold}}}}}
    - {{name: last, type: model, model: dear, logprobs: false}}
state: {state}
"""


def decide(url: str, body: dict[str, object] = QUESTION) -> httpx.Response:
    r = httpx.post(f"{url}/v1/decide", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_a_hit_asks_no_tier_and_costs_nothing(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy("{store: memory}"))
    miss = decide(gw.base_url)
    assert miss.headers["x-triage-cache"] == "miss" and miss.json()["cache"] == "miss"
    # both model tiers were asked and priced: the escalated one too
    charged = float(miss.headers["x-triage-cost"])
    assert [s["tier"] for s in miss.json()["trace"]] == ["first", "last"] and charged > 0
    t0 = time.perf_counter()
    hit = decide(gw.base_url)
    took = time.perf_counter() - t0
    assert hit.headers["x-triage-cache"] == "hit" and hit.json()["cache"] == "hit"
    assert took < 0.25  # the slow tier (0.3 s) was not asked
    assert hit.json()["answer"] == miss.json()["answer"] and hit.json()["trace"] == miss.json()["trace"]
    assert float(hit.headers["x-triage-cost"]) == 0.0
    # another question, other options, a context or a request's own thresholds: not the same decision
    for other in (
        {**QUESTION, "question": "Pick two."},
        {**QUESTION, "options": ["x", "y"]},
        {**QUESTION, "context": "a passage"},
        {**QUESTION, "policy_overrides": {"thresholds": {"first": {"choice": 0.5}}}},
    ):
        assert decide(gw.base_url, other).headers["x-triage-cache"] == "miss", other
    metrics = httpx.get(f"{gw.base_url}/metrics").text
    # spend per model: the cheap tier on every miss, the dear one where it was asked
    assert 'triage_spend_total{key="-",model="cheap"}' in metrics
    assert 'triage_spend_total{key="-",model="dear"}' in metrics


def test_off_unless_the_policy_asks(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy("{store: memory}", ttl="on_exhausted: error"))
    r = decide(gw.base_url)
    assert "x-triage-cache" not in r.headers and "cache" not in r.json()
    assert decide(gw.base_url).json()["trace"][-1]["latency_ms"] >= 250  # asked again


def test_the_cache_survives_a_restart_and_a_reload_bypasses_it(
    redis_url: str, gateways: Callable[[str, int], list[str]], gateway: Callable[..., Gateway]
) -> None:
    state = f'{{store: redis, url: "{redis_url}", prefix: "t-cache"}}'
    [first] = gateways(policy(state), 1)
    assert decide(first).headers["x-triage-cache"] == "miss"
    assert decide(first).headers["x-triage-cache"] == "hit"
    # a second gateway process on the same policy and Redis (a restart, or another of the fleet)
    [second] = gateways(policy(state), 1)
    assert decide(second).headers["x-triage-cache"] == "hit"
    # a reload that changes the policy changes its version: nothing decided before is served
    gw = gateway(policy(state), watch=True)
    assert decide(gw.base_url).headers["x-triage-cache"] == "hit"
    time.sleep(0.3)  # let the watcher start
    gw.policy_path.write_text(policy(state, threshold=0.65))
    deadline = time.monotonic() + 10
    applied = 'triage_policy_reloads_total{outcome="applied"} 1.0'
    while applied not in httpx.get(f"{gw.base_url}/metrics").text and time.monotonic() < deadline:
        time.sleep(0.1)
    after = decide(gw.base_url)
    assert after.headers["x-triage-cache"] == "miss"
    assert decide(gw.base_url).headers["x-triage-cache"] == "hit"


def test_a_cascade_without_an_answer_still_charges_the_tiers_it_asked(gateway: Callable[..., Gateway]) -> None:
    # both tiers answer a letter that names no option: a 502, after two priced model calls
    text = policy("{store: memory}").replace('text: "B"', 'text: "none of these"')
    gw = gateway(text)
    r = httpx.post(f"{gw.base_url}/v1/decide", json=QUESTION, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "cascade_exhausted", r.text
    metrics = httpx.get(f"{gw.base_url}/metrics").text
    assert 'triage_spend_total{key="-",model="cheap"}' in metrics
    assert 'triage_spend_total{key="-",model="dear"}' in metrics


def test_an_entry_that_does_not_read_is_a_miss() -> None:
    from gateway.service import decisions

    assert decisions.unpack(b"not json") is None
    assert decisions.unpack(b'{"answer": "x", "unknown": 1, "trace": []}') is None  # another version's shape
