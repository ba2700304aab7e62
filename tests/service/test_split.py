"""Weighted splits (a `split` virtual model): each request goes to one target by weight, sticky per
caller, the choice in a header and the log; a reload changes the weights mid-traffic without a
failed request; bad splits are refused with their place. A real gateway (uvicorn) and a scripted
backend; the pure choice in policies/plans.py."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from policies.plans import SplitPlan, split_target
from tests.conftest import Gateway
from tests.policies.test_policy import problems


def rollout(a: float, b: float, sticky: str = "user") -> str:
    return f"""version: 1
backends: {{script: {{type: scripted, text: ok}}}}
models:
  current: {{backend: script}}
  candidate: {{backend: script}}
virtual_models:
  chat: {{type: split, targets: {{current: {a}, candidate: {b}}}, sticky: {sticky}}}
"""


HI = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def within(count: int, n: int, p: float, z: float = 4.0) -> bool:
    """``count`` of ``n`` within ``z`` standard deviations of a binomial(n, p)'s mean."""
    return abs(count - n * p) <= z * math.sqrt(n * p * (1 - p))


def test_the_choice_is_by_weight_and_sticky_per_caller() -> None:
    plan = SplitPlan("chat", (("current", 90.0), ("candidate", 10.0)), "user")
    got = Counter(split_target(plan, f"user-{i}") for i in range(20_000))
    assert within(got["candidate"], 20_000, 0.1), got
    assert {split_target(plan, "user-7") for _ in range(50)} == {split_target(plan, "user-7")}
    drawn = Counter(split_target(plan, None) for _ in range(4_000))  # no id: drawn anew each time
    assert within(drawn["candidate"], 4_000, 0.1), drawn
    wider = SplitPlan("chat", (("current", 50.0), ("candidate", 50.0)), "user")
    moved = [i for i in range(2_000) if split_target(plan, f"u{i}") != split_target(wider, f"u{i}")]
    assert all(split_target(wider, f"u{i}") == "candidate" for i in moved)  # 10 -> 50: only toward the candidate


def test_a_split_over_2000_requests_lands_by_weight_sticky_per_user(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(rollout(90, 10))
    with httpx.Client(base_url=gw.base_url, timeout=30) as http:

        def ask(user: str) -> str:
            body = {"model": "chat", "user": user, "messages": [{"role": "user", "content": "hi"}]}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-triage-model"] == r.headers["x-triage-split"].split("=")[1]
            return r.headers["x-triage-split"]

        with ThreadPoolExecutor(8) as pool:
            got = Counter(pool.map(ask, [f"user-{i}" for i in range(2_000)]))
        assert set(got) == {"chat=current", "chat=candidate"}
        assert within(got["chat=candidate"], 2_000, 0.1), got
        assert len({ask("user-42") for _ in range(20)}) == 1  # one user, one model, all through the rollout


def test_a_reload_changes_the_split_mid_traffic_without_a_failed_request(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(rollout(90, 10, sticky="none"), watch=True)
    time.sleep(0.3)  # the watcher starts
    statuses: list[int] = []

    def ask(i: int) -> None:
        with httpx.Client(base_url=gw.base_url, timeout=30) as http:
            for _ in range(60):
                r = http.post(
                    "/v1/chat/completions", json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
                )
                statuses.append(r.status_code)

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(ask, i) for i in range(4)]
        time.sleep(0.2)
        gw.policy_path.write_text(rollout(1, 99, sticky="none"))  # roll forward to the candidate
        for f in running:
            f.result()
    assert statuses and set(statuses) == {200}, Counter(statuses)
    deadline = time.monotonic() + 10
    with httpx.Client(base_url=gw.base_url, timeout=30) as http:
        while time.monotonic() < deadline:  # the new weights serve once the reload is done
            after = Counter(
                http.post(
                    "/v1/chat/completions", json={"model": "chat", "messages": [{"role": "user", "content": "x"}]}
                ).headers["x-triage-split"]
                for _ in range(100)
            )
            if after["chat=candidate"] >= 90:
                break
            time.sleep(0.2)
    assert after["chat=candidate"] >= 90, after


def test_bad_splits_are_refused_with_their_place() -> None:
    text = """version: 1
backends: {script: {type: scripted}}
models:
  current: {backend: script}
virtual_models:
  auto: {type: alias, targets: [current]}
  a: {type: split, targets: {current: 0, auto: 1}}
  c: {type: split, targets: {current: 1}, sticky: device}
  d: {type: split, targets: {}}
"""
    found = problems(text)
    assert (
        "p.yaml:7:20: virtual_models.a.split.targets: Value error, weights must be positive and finite: current"
        in found
    )
    assert "p.yaml:8:43: virtual_models.c.split.sticky: Input should be 'user', 'key', 'session' or 'none'" in found
    assert any(
        p.startswith("p.yaml:9:20: virtual_models.d.split.targets: Dictionary should have at least 1") for p in found
    )
    unknown = """version: 1
backends: {script: {type: scripted}}
models:
  current: {backend: script}
virtual_models:
  b: {type: split, targets: {current: 1, ghost: 1}}
"""  # references are checked once the schema holds
    assert problems(unknown) == [
        "p.yaml:6:42: virtual_models.b.targets.ghost: 'ghost' is not a model or an alias/semantic/routed virtual model"
    ]
