"""Live-traffic quality (issue 32): shadow checks of the answers kept below the top, feedback,
the estimates with their intervals, drift, and what bad input gets. A real gateway under uvicorn
with scripted upstreams whose agreement is known and changes mid-run: the cheap tier always says
"A"; the top says "B" to questions marked [hard], so the true agreement is the share unmarked."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from eval.tier_outputs import typed_rows
from gateway.cli import app as cli
from policies import quality
from policies.errors import PolicyInvalid
from policies.loader import parse as load_text
from policies.schema import ModelSpec
from policies.spend import dearest as reference
from tests.conftest import Gateway

ADMIN = "sk-admin-quality"
ALICE, BOB = "sk-alice-quality", "sk-bob-quality"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy(
    shadow: str = "{sample: 1.0, budget_per_day: 10.0, concurrency: 64}",
    top: str = 'text: "A", replies: [{contains: "[hard]", text: "B"}]',
    quality_: str = "{path: quality.sqlite3, target: 0.8, min_pairs: 20, check_every_s: 0.1}",
    log_prompts: bool = True,
) -> str:
    return f"""version: 1
backends:
  cheap_b: {{type: scripted, text: "A"}}
  top_b: {{type: scripted, {top}}}
models:
  cheap: {{backend: cheap_b, prices: {{input_per_mtok: 1, output_per_mtok: 1}}}}
  top: {{backend: top_b, prices: {{input_per_mtok: 1000, output_per_mtok: 1000}}}}
virtual_models:
  auto: {{type: cascade, open: cheap}}
cascade:
  tiers:
    - {{name: small, type: model, model: cheap, logprobs: false, assumed_confidence: 0.9, thresholds: {{choice: 0.5}}}}
    - {{name: big, type: model, model: top, logprobs: false}}
  shadow: {shadow}
quality: {quality_}
keys:
  - {{name: alice, sha256: "{sha(ALICE)}"}}
  - {{name: bob, sha256: "{sha(BOB)}"}}
access: {{admin_key: "{sha(ADMIN)}"}}
logging: {{log_prompts: {str(log_prompts).lower()}}}
"""


def decide(http: httpx.Client, i: int, hard: bool, key: str = ALICE) -> httpx.Response:
    q = f"Question {i}: which letter?" + (" [hard]" if hard else "")
    r = http.post(
        "/v1/decide",
        json={"question": q, "type": "choice", "options": ["first", "second"]},
        headers={"authorization": f"Bearer {key}"},
    )
    assert r.status_code == 200, r.text
    return r


def report(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/admin/quality", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return r.json()


def settled(http: httpx.Client, pairs: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """The report once ``pairs`` shadow pairs (and their checks) are in."""
    deadline = time.monotonic() + timeout_s
    while True:
        rep = report(http)
        model = next((e for e in rep["estimates"] if e["model"] == "cascade" and e["slice"] is None), None)
        if model is not None and model["pairs"] >= pairs:
            return rep
        assert time.monotonic() < deadline, rep
        time.sleep(0.1)


def cascade_estimate(rep: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in rep["estimates"] if e["model"] == "cascade" and e["slice"] is None)


def test_the_estimate_covers_the_true_agreement_and_drift_is_flagged_after_the_change(
    gateway: Callable[..., Gateway], tmp_path: Path
) -> None:
    gw = gateway(policy())
    with gw.http() as http:
        for i in range(100):  # one in ten hard: the cheap tier agrees with the top on 90%
            r = decide(http, i, hard=i % 10 == 0)
            assert r.json()["tier"] == "small" and r.json()["answer"] == "first"
        rep = settled(http, 100)
        e = cascade_estimate(rep)
        assert e["records"] == 100 and e["pairs"] == 100 and e["top_share"] == 0
        lo, hi = e["agreement_interval"]
        assert e["agreement"] == pytest.approx(0.9) and lo <= 0.9 <= hi and hi - lo < 0.2
        assert e["of_top"] == pytest.approx(0.9) and e["by_tier"]["small"]["pairs"] == 100
        # always-top cost is estimated from the shadow calls' measured price, and more than was paid
        assert e["always_top_cost"] > e["cost"] > 0 and e["saved"] == pytest.approx(e["always_top_cost"] - e["cost"])
        assert rep["drift"] == [] and "quality" not in http.get("/ready").json()
        # the traffic changes: seven in ten hard; the drift is flagged within 50 requests
        flagged_at = None
        for k in range(1, 81):
            decide(http, 1000 + k, hard=k % 10 < 7)
            if k % 10 == 0:
                rep = settled(http, 100 + k)
                if rep["drift"]:
                    flagged_at = k
                    break
        assert flagged_at is not None and flagged_at <= 50, flagged_at
        e = cascade_estimate(rep)
        true = (90 + sum(1 for k in range(1, flagged_at + 1) if k % 10 >= 7)) / (100 + flagged_at)
        assert e["agreement_interval"][0] <= true <= e["agreement_interval"][1]
        ready = http.get("/ready").json()
        assert ready["status"] == "ready" and "cascade" in ready["quality"]["drift"][0]
        deadline = time.monotonic() + 5
        while 'triage_quality_drift{model="cascade",slice=""} 1.0' not in (
            m := http.get("/metrics", headers={"authorization": f"Bearer {ALICE}"}).text
        ):
            assert time.monotonic() < deadline, m[-3000:]
            time.sleep(0.1)
        assert 'triage_shadow_total{model="cascade",result="agree"}' in m
        assert 'triage_shadow_total{model="cascade",result="disagree"}' in m
        assert 'triage_quality_of_top{bound="low",model="cascade",slice=""}' in m
    # the operator's command: the table (the drifting row said), and the plot
    png = tmp_path / "quality.png"
    out = CliRunner().invoke(cli, ["quality", "--url", gw.base_url, "--admin-key", ADMIN, "--plot", str(png)])
    assert out.exit_code == 0, out.output
    assert "cascade" in out.output and "drift" in out.output and png.stat().st_size > 1000
    # the recorded decisions as a labeled set triage eval reads: the top's answer is the label
    labeled = tmp_path / "traffic.jsonl"
    out = CliRunner().invoke(cli, ["quality", "--url", gw.base_url, "--admin-key", ADMIN, "--export", str(labeled)])
    assert out.exit_code == 0, out.output
    rows = typed_rows(labeled, "dev") + typed_rows(labeled, "test")
    assert len(rows) == 100 + flagged_at and {r.source for r in rows} == {"traffic:cascade"}
    assert all(r.answer == ("second" if "[hard]" in r.question.question else "first") for r in rows)


def test_the_budget_is_never_exceeded_and_shadow_cost_never_reaches_the_callers_spend(
    gateway: Callable[..., Gateway],
) -> None:
    # one check reserves (prompt characters + 64) tokens at 1000 per million each way: about 0.3;
    # a budget of 1.0 lets three through at a time, then pauses. The top answers after a second, so
    # the reservations overlap: a check that settled at once (its real cost, 0.02) before the next
    # request came would free its reservation, and thirty such never reach the budget
    gw = gateway(policy(shadow="{sample: 1.0, budget_per_day: 1.0, concurrency: 64}", top='text: "A", latency_s: 1.0'))
    with gw.http() as http:
        costs = [float(decide(http, i, hard=False).headers["x-triage-cost"]) for i in range(30)]
        rep = settled(http, 1)
        deadline = time.monotonic() + 10
        while (rep := report(http))["shadow"].get("cascade/agree", 0) + rep["shadow"].get(
            "cascade/paused_budget", 0
        ) < 30:
            assert time.monotonic() < deadline, rep
            time.sleep(0.1)
        e = cascade_estimate(rep)
        assert 1 <= e["pairs"] < 30 and rep["shadow"]["cascade/paused_budget"] >= 1
        assert rep["shadow_cost_today"]["cascade"] <= 1.0
        # the caller paid the cheap tier only: its cost is the same on every request, the top's price never in it
        cheap_only = costs[0]
        assert all(c == pytest.approx(cheap_only) for c in costs) and 0 < cheap_only < 0.001


def test_a_failing_or_slow_top_never_touches_the_answer(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(
        policy(
            shadow="{sample: 1.0, budget_per_day: 10.0, concurrency: 64, timeout_s: 0.3}",
            top='text: "B", latency_s: 2.0',
        )
    )
    with gw.http() as http:
        t0 = time.monotonic()
        for i in range(5):
            r = decide(http, i, hard=False)
            assert r.json()["tier"] == "small"
        assert time.monotonic() - t0 < 1.5  # five answers while each shadow call takes 2 s (timing out at 0.3)
        deadline = time.monotonic() + 10
        while report(http)["shadow"].get("cascade/failed", 0) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert cascade_estimate(report(http))["pairs"] == 0


def test_feedback_is_the_callers_own_and_counted(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(shadow="{sample: 0.01, budget_per_day: 10.0}"))
    with gw.http() as http:
        rid = decide(http, 1, hard=False).headers["x-request-id"]
        other = decide(http, 2, hard=False, key=BOB).headers["x-request-id"]

        def give(body: Any, key: str = ALICE) -> httpx.Response:
            return http.post("/v1/feedback", json=body, headers={"authorization": f"Bearer {key}"})

        ok = give({"request_id": rid, "verdict": "wrong"})
        assert ok.status_code == 200 and ok.json() == {
            "object": "feedback",
            "request_id": rid,
            "verdict": "wrong",
            "score": None,
        }
        assert give({"request_id": rid, "verdict": "right", "score": 0.5}).status_code == 200  # the latest counts
        for body, key, status in (
            ({"request_id": other, "verdict": "right"}, ALICE, 404),  # bob's request
            ({"request_id": "no-such-request", "verdict": "right"}, ALICE, 404),
            ({"request_id": rid}, ALICE, 400),  # neither a verdict nor a score
            ({"request_id": rid, "verdict": "maybe"}, ALICE, 400),
            ({"request_id": rid, "verdict": "right", "extra": 1}, ALICE, 400),
            ({"request_id": rid, "verdict": "right"}, "sk-nobody", 401),
        ):
            r = give(body, key)
            assert r.status_code == status and r.json()["error"]["type"], (body, r.text)
        assert give({"request_id": other, "verdict": "right"}, BOB).status_code == 200
        e = cascade_estimate(report(http))
        assert e["feedback"] == 2 and e["feedback_right"] == 1.0 and e["mean_score"] == 0.5
        assert http.get("/healthz").status_code == 404 and http.get("/health").status_code == 200  # still serving


def test_without_a_quality_section_feedback_and_the_report_are_404(gateway: Callable[..., Gateway]) -> None:
    text = policy().replace("  shadow: {sample: 1.0, budget_per_day: 10.0, concurrency: 64}\n", "")
    text = text.replace("quality: {path: quality.sqlite3, target: 0.8, min_pairs: 20, check_every_s: 0.1}\n", "")
    gw = gateway(text)
    with gw.http() as http:
        r = http.post(
            "/v1/feedback", json={"request_id": "x", "verdict": "right"}, headers={"authorization": f"Bearer {ALICE}"}
        )
        assert r.status_code == 404 and "quality" in r.json()["error"]["message"]
        r = http.get("/admin/quality", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 404


def test_a_shadow_needs_a_top_and_a_quality_section() -> None:
    with pytest.raises(PolicyInvalid) as err:
        load_text(
            policy().replace("quality: {path: quality.sqlite3, target: 0.8, min_pairs: 20, check_every_s: 0.1}\n", "")
        )
    assert "shadow checks, mirrors and guards need a `quality` section" in str(err.value)
    one_tier = policy().replace("    - {name: big, type: model, model: top, logprobs: false}\n", "")
    with pytest.raises(PolicyInvalid) as err:
        load_text(one_tier)
    assert "two tiers or more" in str(err.value)
    with pytest.raises(PolicyInvalid) as err:
        load_text(policy(shadow="{sample: 0, budget_per_day: 1}"))
    assert "cascade.shadow.sample" in str(err.value)


def test_the_interval_and_the_share_of_the_top() -> None:
    assert quality.wilson(0, 0) == (0.0, 1.0)
    lo, hi = quality.wilson(90, 100)
    assert 0.82 < lo < 0.9 < hi < 0.95
    rows = [
        quality.Counts("m", "cascade", "small", False, "choice", 80, pairs=40, agree=30, shadow_cost=4.0, cost=0.8),
        quality.Counts("m", "cascade", "big", True, "choice", 20, cost=2.0),
        quality.Counts("m", "cascade", "small", False, "yes_no", 100, pairs=10, agree=10, right=3, wrong=1),
    ]
    found = quality.estimates(rows)
    assert [(e.model, e.slice) for e in found] == [("m", ""), ("m", "choice"), ("m", "yes_no")]
    choice = found[1]
    assert choice.top_share == 0.2 and choice.agreement == 0.75
    assert choice.of_top == pytest.approx((20 + 80 * 0.75) / 100)
    lo, hi = quality.wilson(30, 40)
    assert choice.of_top_interval == pytest.approx(((20 + 80 * lo) / 100, (20 + 80 * hi) / 100))
    assert choice.always_top_cost == pytest.approx(2.0 + 80 * 0.1) and choice.saved == pytest.approx(10.0 - 2.8)
    assert found[2].feedback_right == 0.75 and found[2].of_top == 1.0
    drift = quality.quality_drift(found, target=0.95, min_pairs=20)
    assert [d.label for d in drift] == ["m", "m/choice"]  # yes_no: 10 pairs, too few to judge


def test_a_routed_models_top_is_its_dearest_candidate() -> None:
    models = {
        "small": ModelSpec(backend="b", prices={"input_per_mtok": 0.1, "output_per_mtok": 0.2}),
        "large": ModelSpec(backend="b", prices={"input_per_mtok": 3, "output_per_mtok": 15}),
    }
    assert reference(models, ["small", "large"]) == "large"


def test_a_move_in_the_traffics_mix_of_question_types_is_drift_too(gateway: Callable[..., Gateway]) -> None:
    text = policy(
        quality_="{path: quality.sqlite3, check_every_s: 0.1, mix_recent_s: 1.5, mix_min_records: 20}",
        shadow="{sample: 0.01, budget_per_day: 1.0}",
    ).replace(
        'cheap_b: {type: scripted, text: "A"}',
        'cheap_b: {type: scripted, text: "A", replies: [{contains: "[yn]", text: "yes"}]}',
    )
    gw = gateway(text.replace("thresholds: {choice: 0.5}", "thresholds: {choice: 0.5, yes_no: 0.5}"))
    with gw.http() as http:
        for i in range(60):
            decide(http, i, hard=False)
        time.sleep(1.6)  # the choice questions are out of the recent part now
        auth = {"authorization": f"Bearer {ALICE}"}
        for i in range(30):
            r = http.post("/v1/decide", json={"question": f"Is {i} even? [yn]", "type": "yes_no"}, headers=auth)
            assert r.status_code == 200 and r.json()["tier"] == "small", r.text
        deadline = time.monotonic() + 10
        while not (drift := report(http)["drift"]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert drift[0]["kind"] == "mix" and drift[0]["model"] == "cascade" and "yes_no 100%" in drift[0]["reason"]


def test_the_mix_drift_compares_the_recent_traffic_with_what_came_before() -> None:
    window = {"m": {"choice": 100, "yes_no": 60}}
    assert [d.kind for d in quality.mix_drift(window, {"m": {"yes_no": 60}}, 0.3, 20)] == ["mix"]
    assert quality.mix_drift(window, {"m": {"yes_no": 10}}, 0.3, 20) == []  # too few recent records
    same = {"m": {"choice": 25, "yes_no": 15}}  # the same shares as before
    assert quality.mix_drift(window, same, 0.3, 20) == []
