"""Route and cascade as one decision, served (issue 56): the gateway's routed cascade against the
pool benchmark's offline replay (policies/pool_routing.replay) on the same recorded answers, its
trace, and the policy's section."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from policies import loader
from policies.answers import assumed_scores
from policies.cascade import Ask, CascadeExhausted, Gate, Question, TierAnswer, drive
from policies.cascade_routing import Routing, expected_cost, steps_for
from policies.errors import PolicyInvalid
from policies.pool import Agreement
from policies.pool_routing import replay

AG = Agreement(temper=0.9, a=1.05, b=0.05, spread=1.5)
Q = Question("choice", "Which one?", tuple("abcd"))


def said(option: int, k: int = 4) -> TierAnswer:
    return TierAnswer(tuple(assumed_scores(k, option, 0.9)), assumed=True)


def pool(costs: tuple[float, ...] = (0.01, 0.02, 0.2), acc: tuple[float, ...] = (0.55, 0.65, 0.8)) -> list[Gate]:
    names = ("small", "mid", "top")
    return [Gate(n, "model", accuracy={"choice": a}, per_call=c) for n, a, c in zip(names, acc, costs, strict=True)]


def run(answers: dict[str, TierAnswer], gates: list[Gate], knob: float, q: Question = Q):
    asked: list[str] = []

    def answer_for(ask: Ask) -> TierAnswer:
        asked.append(ask.tier)
        return answers[ask.tier]

    return drive(steps_for(q, gates, routing=Routing(knob, {"choice": AG})), answer_for), asked


def test_the_served_routing_is_the_offline_replay() -> None:
    rng = np.random.default_rng(11)
    rows, k = 150, 4
    acc = np.array([0.55, 0.65, 0.8])
    gold = rng.integers(0, k, rows)
    recorded = np.where(rng.random((rows, 3)) < acc, gold[:, None], rng.integers(0, k, (rows, 3)))
    gates = pool()
    cost = np.array([expected_cost(g, Q) for g in gates])
    names = [g.name for g in gates]
    for knob in (0.5, 3.0, 20.0):
        asked_at, answer, _ = replay(recorded, acc, cost, k, AG, knob)
        calls = []
        for r in range(rows):
            d, asked = run({n: said(int(o)) for n, o in zip(names, recorded[r], strict=True)}, gates, knob)
            order = [names[m] for m in np.argsort(asked_at[r]) if asked_at[r, m] >= 0]
            assert asked == order, (knob, r)
            assert d.answer == "abcd"[answer[r]], (knob, r)
            calls.append(len(asked))
        assert min(calls) >= 1
    assert np.mean(calls) < 2.0  # the dear tier's cost counts: at this knob most questions stop early


def test_the_trace_says_what_was_chosen_after_each_step() -> None:
    d, asked = run({"small": said(1), "mid": said(1), "top": said(2)}, pool(), 3.0)
    assert [s.tier for s in d.trace] == asked
    assert [s.next for s in d.trace] == [*asked[1:], "stop"]
    assert [s.outcome for s in d.trace] == ["escalated"] * (len(asked) - 1) + ["accepted"]
    assert d.trace[-1].as_dict()["next"] == "stop" and d.trace[-1].votes is not None
    assert d.assumed is False and d.tier == asked[-1]


def test_a_failed_tier_is_not_asked_again_and_a_barred_one_never() -> None:
    gates = pool()
    gates[0] = dataclasses.replace(gates[0], barred="the key may not reach it")
    d, asked = run({"mid": TierAnswer(error="timeout"), "top": said(3)}, gates, 20.0)  # mid first: top is dear
    assert asked == ["mid", "top"] and d.answer == "d"
    assert [s.outcome for s in d.trace] == ["failed", "accepted", "skipped"] and d.trace[0].next == "top"
    with pytest.raises(CascadeExhausted):
        run({"mid": TierAnswer(error="timeout"), "top": TierAnswer(error="down")}, gates, 20.0)


def test_a_number_or_an_unrouted_type_takes_the_listed_order() -> None:
    gates = [dataclasses.replace(g, thresholds={"yes_no": 0.99}) for g in pool()]
    yn = Question("yes_no", "Is it?", ("yes", "no"))
    d, asked = run({n: said(0, 2) for n in ("small", "mid", "top")}, gates, 3.0, yn)
    assert asked == ["small", "mid", "top"] and d.trace[0].next is None


def test_the_policy_section() -> None:
    base = """version: 1
backends: {b: {type: openai, replicas: [{api_base: "http://127.0.0.1:9/v1"}]}}
models: {m: {backend: b}}
cascade:
  EXTRA
  tiers:
    - {name: one, type: model, model: m, accuracy: {choice: 0.6}, prices: {per_call: 0.001}}
    - {name: two, type: model, model: m, accuracy: {choice: 0.7}, prices: {per_call: 0.01}}
"""
    ok = loader.parse(base.replace("EXTRA", "routing: {knob: 40, agreement: {choice: {spread: 1.5}}}"))
    assert ok.cascade is not None and ok.cascade.routing is not None and ok.cascade.routing.knob == 40
    with pytest.raises(PolicyInvalid, match="escalation_budget moves none"):
        loader.parse(base.replace("EXTRA", "routing: {knob: 40, agreement: {choice: {}}}\n  escalation_budget: 0.5"))
    with pytest.raises(PolicyInvalid):
        loader.parse(base.replace("EXTRA", "routing: {knob: 40, agreement: {}}"))
