"""The online escalation budget: a shifting synthetic stream through the real cascade generator
(pure), and the gateway holding it on a live cascade, with its state in /metrics."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from policies.budget import EscalationBudget
from policies.cascade import Gate, Question, TierAnswer, drive, steps
from tests.conftest import Gateway

GATES = [Gate("scorer", "scorer", {"choice": 0.7}), Gate("pool", "model")]
Q = Question("choice", "q", ("a", "b", "c", "d"))


def answer_with(confidence: float) -> TierAnswer:
    """Scores whose top option has this probability (the rest shared evenly)."""
    rest = (1 - confidence) / 3
    return TierAnswer(scores=(math.log(confidence), *(math.log(rest),) * 3))


def stream(budget: EscalationBudget, confidences: np.ndarray) -> list[bool]:
    escalated = []
    for c in confidences:
        d = drive(
            steps(Q, budget.gates(GATES)), lambda ask, c=c: answer_with(c) if ask.tier == "scorer" else answer_with(0.9)
        )
        budget.observe(d.trace[0])
        escalated.append(d.trace[0].outcome == "escalated")
    return escalated


def test_the_budget_holds_under_shifting_traffic() -> None:
    rng = np.random.default_rng(0)
    budget = EscalationBudget(0.3, step=0.01, max_shift=0.4, floor=0.0)
    easy = np.clip(rng.normal(0.85, 0.1, 3000), 0.3, 0.99)  # fixed thresholds escalate ~7% of these
    hard = np.clip(rng.normal(0.55, 0.1, 3000), 0.3, 0.99)  # and ~93% of these
    for phase in (easy, hard, easy):
        got = stream(budget, phase)
        fixed = float((phase < 0.7).mean())
        assert abs(np.mean(got[1000:]) - 0.3) < 0.04, (fixed, np.mean(got[1000:]), budget.offset)
    assert budget.share is not None and abs(budget.share - 0.3) < 0.06


def test_the_quality_floor_wins_over_the_budget() -> None:
    rng = np.random.default_rng(1)
    budget = EscalationBudget(0.1, step=0.02, max_shift=0.5, floor=0.6)
    got = stream(budget, np.clip(rng.normal(0.45, 0.05, 2000), 0.3, 0.99))  # all below the floor
    assert budget.shifted({"choice": 0.7})["choice"] == pytest.approx(0.6)  # never under the floor
    assert np.mean(got[500:]) > 0.9  # so it escalates more than the budget rather than keep them
    assert budget.offset >= -0.5


def test_skipped_or_failed_first_tiers_do_not_move_it() -> None:
    budget = EscalationBudget(0.3)
    d = drive(
        steps(Q, budget.gates(GATES)),
        lambda ask: TierAnswer(error="down") if ask.tier == "scorer" else answer_with(0.9),
    )
    budget.observe(d.trace[0])
    assert budget.offset == 0 and budget.share is None


POLICY = """version: 1
backends:
  cheap: {type: scripted, text: "B"}
  dear: {type: scripted, text: "B"}
models:
  cheap: {backend: cheap}
  dear: {backend: dear}
cascade:
  escalation_budget: 0.3
  budget_step: 0.02
  tiers:
    - {name: first, type: model, model: cheap, logprobs: false, assumed_confidence: 0.6, thresholds: {choice: 0.7}}
    - {name: last, type: model, model: dear, logprobs: false}
"""


def test_the_gateway_holds_the_budget_and_reports_it(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(POLICY)
    tiers = []
    with gw.http() as http:
        for _ in range(120):
            r = http.post("/v1/decide", json={"question": "Pick.", "type": "choice", "options": ["x", "y", "z"]})
            assert r.status_code == 200, r.text
            tiers.append(r.json()["tier"])
        metrics = http.get("/metrics").text
    # fixed thresholds would escalate every question (0.6 < 0.7); the budget lowers the first tier's
    # threshold until about 30% go on
    assert 0.15 < tiers[40:].count("last") / 80 < 0.45, tiers
    assert "triage_cascade_escalation_target 0.3" in metrics
    offset = float(
        next(line for line in metrics.splitlines() if line.startswith("triage_cascade_threshold_offset")).split()[1]
    )
    assert -0.3 <= offset < -0.05
