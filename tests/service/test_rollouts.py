"""Mirrors and guarded rollouts (issue 54): a mirror never changes the answer or the caller's
cost and leaves its records; a split's candidate that fails, or that disagrees with the primary,
is rolled back within its guard's bound, with a log event, a metric and a line in the report;
bad settings are refused with their place. Real gateways (uvicorn) over scripted backends; the
rules themselves (pure) in policies/rollouts.py."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.http import console_auth
from gateway.service.quality.watch import FLUSH_S
from policies import quality, rollouts
from policies.plans import SplitPlan, split_target
from policies.rollouts import GuardSpec
from tests.conftest import Gateway
from tests.policies.test_policy import problems

ADMIN, ALICE = "sk-admin-rollouts", "sk-alice-rollouts"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def policy(candidate: str, virtual: str = "", mirrors: str = "", candidate_model: str = "") -> str:
    return f"""version: 1
backends:
  cur_b: {{type: scripted, text: "Paris is the capital of France."}}
  cand_b: {{type: scripted, {candidate}}}
models:
  current: {{backend: cur_b, prices: {{input_per_mtok: 1, output_per_mtok: 2}}}}
  candidate: {{backend: cand_b, prices: {{input_per_mtok: 100, output_per_mtok: 200}}{candidate_model}}}
virtual_models: {{{virtual}}}
mirrors: {{{mirrors}}}
quality: {{path: quality.sqlite3, check_every_s: 0.1}}
keys: [{{name: alice, sha256: "{sha(ALICE)}"}}]
access: {{admin_key: "{sha(ADMIN)}"}}
"""


def chat(http: httpx.Client, model: str, text: str = "What is the capital of France?", **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **extra}
    return http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {ALICE}"})


def report(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/admin/quality", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return r.json()


def estimate(rep: dict[str, Any], model: str, slice_: str | None = None) -> dict[str, Any] | None:
    return next((e for e in rep["estimates"] if e["model"] == model and e["slice"] == slice_), None)


def until(check: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.05)
    return found


def report_when(http: httpx.Client, ready: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        rep = report(http)
        return rep if ready(rep) else None

    found: dict[str, Any] = until(check)
    return found


# -- the rules ---------------------------------------------------------------------------------


def counts(target: str, outcome: str, records: int, pairs: int = 0, agree: int = 0) -> quality.Counts:
    return quality.Counts("chat", rollouts.SPLIT, target, target == "current", outcome, records, pairs, agree)


def test_the_guard_judges_on_the_interval_once_there_is_enough_evidence() -> None:
    guard = GuardSpec(max_error_rate=0.05, min_requests=20, min_agreement=0.8)
    few = [counts("candidate", rollouts.ERROR, 19)]
    assert rollouts.verdict("chat", guard, "current", few) == []  # 19 of 19 failed: not yet judged
    failing = [counts("candidate", rollouts.OK, 15), counts("candidate", rollouts.ERROR, 5)]
    (back,) = rollouts.verdict("chat", guard, "current", failing)
    assert back.target == "candidate" and back.errors == 5 and "error rate" in back.reason
    noisy = [counts("candidate", rollouts.OK, 95), counts("candidate", rollouts.ERROR, 5)]
    assert rollouts.verdict("chat", guard, "current", noisy) == []  # 5%: the lower bound is under it
    primary_failing = [counts("current", rollouts.ERROR, 50)]
    assert rollouts.verdict("chat", guard, "current", primary_failing) == []  # the primary is never rolled back
    disagreeing = [counts("candidate", rollouts.OK, 40, pairs=30, agree=15)]
    (back,) = rollouts.verdict("chat", guard, "current", disagreeing)
    assert "agreement" in back.reason and back.pairs == 30
    agreeing = [counts("candidate", rollouts.OK, 40, pairs=30, agree=25)]  # 83%: the upper bound is over 0.8
    assert rollouts.verdict("chat", guard, "current", agreeing) == []


def test_a_rolled_back_candidate_gives_its_callers_to_the_primary_and_no_one_else_moves() -> None:
    targets = (("current", 80.0), ("candidate", 10.0), ("other", 10.0))
    plan = SplitPlan("chat", targets, "user")
    assert rollouts.primary_of(targets, None) == "current"
    assert rollouts.primary_of(targets, GuardSpec(primary="other")) == "other"
    after = rollouts.without(targets, {"candidate"}, "current")
    for i in range(2_000):
        was, now = split_target(plan, f"u{i}"), split_target(plan, f"u{i}", after)
        assert now == ("current" if was == "candidate" else was)
    assert rollouts.signature(targets) != rollouts.signature(after) == rollouts.signature(after)


def test_bad_mirrors_and_guards_are_refused_with_their_place() -> None:
    text = policy(
        'text: "x"',
        virtual="chat: {type: split, targets: {current: 9, candidate: 1}, guard: {primary: nope, min_agreement: 0.9}}, "
        "solo: {type: split, targets: {current: 1}, guard: {}}",
        mirrors="current: {to: ghost, budget_per_day: 1}, nowhere: {to: candidate, budget_per_day: 1}, "
        "candidate: {to: candidate, budget_per_day: 1}",
    )
    found = "\n".join(problems(text))
    assert "virtual_models.chat.guard.primary: 'nope' is not one of the targets" in found
    assert "virtual_models.chat.guard.min_agreement: an agreement bound needs the split's `shadow` checks" in found
    assert "virtual_models.solo.guard: a guard needs a candidate beside the primary" in found
    assert "mirrors.current.to: 'ghost' is not a model of the policy" in found
    assert "mirrors.nowhere: model 'nowhere' is not defined" in found
    assert "mirrors.candidate.to: a mirror's candidate is another model" in found
    no_store = "\n".join(
        problems(
            policy('text: "x"', mirrors="current: {to: candidate, budget_per_day: 1}").replace(
                "quality: {path: quality.sqlite3, check_every_s: 0.1}\n", ""
            )
        )
    )
    assert "mirrors.current: shadow checks, mirrors and guards need a `quality` section" in no_store
    bad = "\n".join(problems(policy('text: "x"', mirrors="current: {to: candidate, budget_per_day: 0, sample: 2}")))
    assert "mirrors.current.budget_per_day" in bad and "mirrors.current.sample" in bad


# -- mirrors -------------------------------------------------------------------------------------


def test_a_mirror_never_changes_the_answer_or_the_cost_and_its_records_appear(
    gateway: Callable[..., Gateway],
) -> None:
    # the candidate says the same on questions about France, something else on the rest
    candidate = 'text: "I do not know.", replies: [{contains: "France", text: "Paris is the capital of France."}]'
    mirrored = gateway(
        policy(candidate, mirrors="current: {to: candidate, sample: 1.0, budget_per_day: 10, concurrency: 64}")
    )
    plain = gateway(policy(candidate).replace("quality.sqlite3", "plain.sqlite3"))  # its own records
    with mirrored.http() as http, plain.http() as alone:
        for i in range(40):
            text = f"Question {i}: what is the capital of France?" if i % 4 else f"Question {i}: what is 2 + 2?"
            got, without = chat(http, "current", text), chat(alone, "current", text)
            assert got.status_code == without.status_code == 200, got.text
            assert got.json()["choices"][0]["message"] == without.json()["choices"][0]["message"]
            assert got.headers["x-triage-model"] == "current"
            assert got.headers["x-triage-cost"] == without.headers["x-triage-cost"]  # the candidate is not charged
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": "current", "stream": True, "messages": [{"role": "user", "content": "France?"}]},
            headers={"authorization": f"Bearer {ALICE}"},
        ) as r:
            assert r.status_code == 200 and b"[DONE]" in r.read()
        rep = report_when(http, lambda x: (estimate(x, "mirror:current") or {}).get("pairs") == 41)
        e = estimate(rep, "mirror:current")
        assert e is not None and e["records"] == 41 and e["top_share"] == 0
        assert e["agreement"] == pytest.approx(31 / 41)  # 30 of the 40 asked about France, and the stream
        assert rep["mirror_latency"]["mirror:current"]["calls"] == 41
        assert rep["shadow"]["mirror:current/agree"] == 31 and rep["shadow"]["mirror:current/disagree"] == 10
        assert estimate(report(alone), "mirror:current") is None
        metrics = http.get("/metrics", headers={"authorization": f"Bearer {ALICE}"}).text
        assert 'triage_mirror_latency_seconds{model="mirror:current",quantile="0.5"}' in metrics


def test_a_failing_mirror_is_recorded_and_never_fails_the_request(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(
        policy('text: "x", fail_first: 1000', mirrors="current: {to: candidate, sample: 1.0, budget_per_day: 10}")
    )
    with gw.http() as http:
        for _ in range(10):
            r = chat(http, "current")
            assert r.status_code == 200 and r.headers["x-triage-model"] == "current", r.text
        rep = report_when(
            http,
            lambda x: (
                x["shadow"].get("mirror:current/failed") == 10
                and (estimate(x, "mirror:current", rollouts.ERROR) or {}).get("records") == 10
            ),
        )
        errors = estimate(rep, "mirror:current", rollouts.ERROR)
        assert errors is not None and errors["pairs"] == 0


# -- guarded rollouts ------------------------------------------------------------------------------


def guarded(candidate: str, guard: str, shadow: str = "", fallbacks: str = "") -> str:
    split = f"chat: {{type: split, targets: {{current: 50, candidate: 50}}, sticky: none, guard: {guard}{shadow}}}"
    return policy(candidate, virtual=split, candidate_model=fallbacks)


def rolled_back(http: httpx.Client) -> list[dict[str, Any]]:
    return list(report(http)["rollbacks"])


def test_a_failing_candidate_is_rolled_back_within_its_bound_with_no_caller_failing(
    gateway: Callable[..., Gateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the candidate fails every call; its fallback (the primary) answers: no caller sees an error
    gw = gateway(guarded('text: "x", fail_first: 100000', "{min_requests: 10}", fallbacks=", fallbacks: [current]"))
    with gw.http() as http:
        tried, tenth = 0, None
        while not rolled_back(http):
            r = chat(http, "chat")
            assert r.status_code == 200 and r.headers["x-triage-model"] == "current", r.text
            tried += r.headers["x-triage-split"] == "chat=candidate"
            if tried == 10 and tenth is None:
                tenth = time.monotonic()
            # the stated window: the watch's next write of its records (FLUSH_S) and its next check
            assert tenth is None or time.monotonic() - tenth < FLUSH_S + 0.1 + 2.0, "not rolled back in its window"
            time.sleep(0.005)
        (back,) = rolled_back(http)
        assert back["split"] == "chat" and back["target"] == "candidate" and back["primary"] == "current"
        assert back["errors"] == back["requests"] >= 10 and "error rate" in back["reason"]
        after = [chat(http, "chat") for _ in range(60)]
        assert all(r.status_code == 200 and r.headers["x-triage-split"] == "chat=current" for r in after)
        metrics = http.get("/metrics", headers={"authorization": f"Bearer {ALICE}"}).text
        assert 'triage_rollout_rolled_back{split="chat",target="candidate"} 1.0' in metrics
        # the console's Decisions page says so
        monkeypatch.setenv(console_auth.SECRET_ENV, "console-test-secret")
        console_auth.secret.cache_clear()
        try:
            login = {"key": ADMIN, "next": "/console"}
            assert http.post("/console/login", data=login, headers={"origin": gw.base_url}).status_code == 303
            page = http.get("/console/decisions").text
        finally:
            console_auth.secret.cache_clear()
        table = page.split('id="rollback-table"', 1)[1].split("</table>", 1)[0]
        assert "chat" in table and "candidate" in table and "error rate" in table


def test_a_candidate_that_disagrees_is_rolled_back_and_a_reload_of_its_weights_restores_it(
    gateway: Callable[..., Gateway],
) -> None:
    shadow = ", shadow: {sample: 1.0, budget_per_day: 10, concurrency: 64}"
    text = guarded('text: "Lyon."', "{min_requests: 12, min_agreement: 0.8}", shadow)
    gw = gateway(text, watch=True)
    with gw.http() as http:
        for _ in range(200):
            assert chat(http, "chat").status_code == 200
            if rolled_back(http):
                break
        (back,) = rolled_back(http)
        assert "agreement with current" in back["reason"] and back["pairs"] >= 12 and back["agree"] == 0
        assert {chat(http, "chat").headers["x-triage-split"] for _ in range(30)} == {"chat=current"}
        # the operator changes the candidate's weight: the rollback is forgotten with the old weights
        gw.policy_path.write_text(text.replace("candidate: 50}", "candidate: 10}"))
        until(lambda: not rolled_back(http))
        until(lambda: chat(http, "chat").headers["x-triage-split"] == "chat=candidate")


def test_gateways_sharing_postgresql_reach_the_same_rollback(gateway: Callable[..., Gateway], database: str) -> None:
    # the traffic goes through one gateway; the other reads the same records and rolls back too
    text = guarded('text: "x", fail_first: 100000', "{min_requests: 10}", fallbacks=", fallbacks: [current]")
    text += f"state: {{database: '{database}'}}\n"
    one, two = gateway(text), gateway(text)
    with one.http() as http, two.http() as other:
        for _ in range(200):
            assert chat(http, "chat").status_code == 200
            if rolled_back(http):
                break
        (back,) = rolled_back(http)
        (seen,) = until(lambda: rolled_back(other), timeout_s=5)
        assert seen["target"] == back["target"] == "candidate" and "error rate" in seen["reason"]
        assert {chat(other, "chat").headers["x-triage-split"] for _ in range(30)} == {"chat=current"}
