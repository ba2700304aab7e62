"""Agreement as a tier's confidence in the cascade (issue 56): pure, with scripted tier answers; the
served generator against the offline chain the pool benchmark measures, on the same answers."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from eval.pool_fit import chain
from policies import loader
from policies.answers import assumed_scores
from policies.cascade import Ask, Gate, Question, TierAnswer, drive, steps
from policies.errors import PolicyInvalid
from policies.pool import Agreement

CHOICE = Question("choice", "Which?", ("a", "b", "c"))
SURE = Agreement(temper=1.0, spread=1.0)


def said(option: int, k: int = 3) -> TierAnswer:
    """A model tier's answer without probabilities: its option at an assumed 0.9, as the gateway reads one."""
    return TierAnswer(tuple(assumed_scores(k, option, 0.9)), assumed=True)


def pool(threshold: float = 0.7) -> list[Gate]:
    return [
        Gate("small", "model", {"choice": 0.99}, accuracy={"choice": 0.6}),
        Gate("mid", "model", {"choice": threshold}, accuracy={"choice": 0.7}, agreement={"choice": SURE}),
        Gate("top", "model", {}, accuracy={"choice": 0.8}, agreement={"choice": SURE}),
    ]


def run(answers: dict[str, TierAnswer], gates: list[Gate], q: Question = CHOICE):
    asked: list[str] = []

    def answer_for(ask: Ask) -> TierAnswer:
        asked.append(ask.tier)
        return answers[ask.tier]

    return drive(steps(q, gates), answer_for), asked


def by_hand(weights: dict[int, float], k: int = 3) -> list[float]:
    """The posterior of votes ``log(p / (1 - p))`` (spread 1) on named options, ``log(1 / (k - 1))`` elsewhere."""
    z = [
        sum(math.log(p / (1 - p)) for o, p in weights.items() if o == i) if i in weights else -math.log(k - 1)
        for i in range(k)
    ]
    e = [math.exp(v) for v in z]
    return [v / sum(e) for v in e]


def test_two_answers_that_agree_are_kept_at_their_measured_confidence() -> None:
    d, asked = run({"small": said(1), "mid": said(1), "top": said(0)}, pool())
    assert asked == ["small", "mid"] and (d.answer, d.tier) == ("b", "mid")
    z = [-math.log(2), math.log(0.6 / 0.4) + math.log(0.7 / 0.3), -math.log(2)]
    expected = math.exp(z[1]) / sum(math.exp(v) for v in z)
    assert d.confidence == pytest.approx(expected) == pytest.approx(0.7778, abs=1e-4)
    assert d.assumed is False  # fitted on dev rows, not the tiers' assumed 0.9
    step = d.trace[1].as_dict()
    assert step["votes"] == {"small": "b", "mid": "b"} and step["agreeing"] == ["small", "mid"]
    assert step["raw_confidence"] == pytest.approx(0.9) and "probabilities" not in step
    assert d.trace[0].as_dict()["probabilities"] == "assumed" and "votes" not in d.trace[0].as_dict()


def test_answers_that_disagree_escalate_and_the_top_reads_all_three() -> None:
    d, asked = run({"small": said(0), "mid": said(1), "top": said(2)}, pool())
    assert asked == ["small", "mid", "top"]
    mid = d.trace[1]
    assert mid.outcome == "escalated" and mid.agreeing == ("mid",)
    assert mid.confidence == pytest.approx(max(by_hand({0: 0.6, 1: 0.7})))  # 0.54: below 0.7
    # the last tier answers whatever its confidence: the votes' top, here the strongest tier's own
    assert (d.answer, d.tier) == ("c", "top") and d.trace[2].votes == {"small": "a", "mid": "b", "top": "c"}


def test_two_cheap_answers_can_outvote_the_top() -> None:
    gates = pool(threshold=0.9)
    d, _ = run({"small": said(0), "mid": said(0), "top": said(2)}, gates)
    assert d.trace[1].outcome == "escalated"  # 0.78 < 0.9
    assert d.answer == "c"  # log(0.8 / 0.2) outweighs log(0.6 / 0.4) + log(0.7 / 0.3)
    gates[0] = dataclasses.replace(gates[0], accuracy={"choice": 0.7})
    d, _ = run({"small": said(0), "mid": said(0), "top": said(2)}, gates)
    assert d.answer == "a" and d.tier == "top" and d.trace[2].agreeing == ("small", "mid")


def test_a_tier_that_failed_casts_no_vote_and_a_tier_without_accuracy_no_weight() -> None:
    gates = pool()
    d, _ = run({"small": TierAnswer(error="timeout"), "mid": said(1), "top": said(2)}, gates)
    assert d.trace[1].votes == {"mid": "b"}
    assert d.trace[1].confidence == pytest.approx(0.7)  # one vote at spread 1: its accuracy
    silent = [Gate("small", "model", {"choice": 0.99}), *gates[1:]]
    d, _ = run({"small": said(0), "mid": said(1), "top": said(2)}, silent)
    assert d.trace[1].confidence == pytest.approx(0.7) and d.trace[1].votes == {"small": "a", "mid": "b"}
    assert d.trace[1].agreeing == ("mid",)


def test_a_number_question_is_read_on_the_tiers_own_confidence() -> None:
    q = Question("score", "How many?", (), None)
    answers = {t: TierAnswer(text="4", confidence=0.95) for t in ("small", "mid", "top")}
    gates = [dataclasses.replace(g, thresholds={"score": g.thresholds.get("choice", 0.0)}) for g in pool()]
    d, asked = run(answers, gates, q)
    assert asked == ["small", "mid"] and d.confidence == pytest.approx(0.95) and d.trace[1].votes is None


def test_the_served_decision_is_the_offline_chain() -> None:
    """The pool benchmark's chain with agreement (eval/pool_fit.chain) and the gateway's cascade agree
    answer for answer and call for call on the same recorded answers."""
    rng = np.random.default_rng(5)
    rows, k = 300, 4
    acc = np.array([0.55, 0.65, 0.8])
    gold = rng.integers(0, k, rows)
    recorded = np.where(rng.random((rows, 3)) < acc, gold[:, None], rng.integers(0, k, (rows, 3)))
    recorded[rng.random((rows, 3)) < 0.05] = -1  # no answer
    ag = Agreement(temper=0.85, a=1.1, b=-0.1, spread=1.5)
    threshold = 0.75
    asked, answer = chain(recorded, np.tile(acc, (rows, 1)), np.full(rows, k), [0, 1, 2], ag, threshold)
    names = ("small", "mid", "top")
    gates = [
        Gate(n, "model", {"choice": threshold}, accuracy={"choice": float(a)}, agreement={"choice": ag})
        for n, a in zip(names, acc, strict=True)
    ]
    q = Question("choice", "?", tuple("abcd"))
    for r in range(rows):
        answers = {
            n: said(int(o), k) if o >= 0 else TierAnswer(error="no answer")
            for n, o in zip(names, recorded[r], strict=True)
        }
        if recorded[r, 2] < 0:
            continue  # the last tier gave nothing: the gateway says so (exhausted), the chain answers the votes
        d, served = run(answers, gates, q)
        assert served == [n for n, a in zip(names, asked[r], strict=True) if a], r
        assert d.answer == "abcd"[answer[r]], r


def test_the_policy_takes_agreement_and_refuses_it_with_a_learned_gate() -> None:
    base = """version: 1
backends: {b: {type: openai, replicas: [{api_base: "http://127.0.0.1:9/v1"}]}}
models: {m: {backend: b}}
cascade:
  tiers:
    - {name: one, type: model, model: m, accuracy: {choice: 0.6}}
    - {name: two, type: model, model: m, TIER}
"""
    ok = loader.parse(base.replace("TIER", "accuracy: {choice: 0.7}, agreement: {choice: {spread: 1.5, temper: 0.9}}"))
    assert ok.cascade is not None and ok.cascade.tiers[1].agreement["choice"].spread == 1.5
    bare = loader.parse(base.replace("TIER", "agreement: {choice: {}}"))  # the numbers: triage eval's to fit
    assert bare.cascade is not None and bare.cascade.tiers[1].accuracy == {}
    with pytest.raises(PolicyInvalid, match="learned model"):
        loader.parse(base.replace("TIER", "gate: learned, accuracy: {choice: 0.7}, agreement: {choice: {}}"))
    with pytest.raises(PolicyInvalid):
        loader.parse(base.replace("TIER", "accuracy: {choice: 1.2}"))


def test_triage_eval_fits_each_tiers_accuracy_and_the_agreement_on_dev_rows() -> None:
    """``triage eval``'s fit (eval/agreement_fit.py) on recorded answers of known accuracy: the
    accuracies come back, and the votes' confidence ranks right answers above wrong ones."""
    from eval.agreement_fit import fit_agreements
    from eval.cascade_eval import TierSpec, gate_confidence
    from eval.tier_outputs import Row

    rng = np.random.default_rng(7)
    rows, k, acc = 600, 4, (0.55, 0.7, 0.85)
    options = tuple("abcd")
    dev = [
        Row(f"r{i}", "set", "dev", Question("choice", f"q{i}", options), options[rng.integers(k)], None)
        for i in range(rows)
    ]
    tiers = []
    for name, a in zip(("small", "mid", "top"), acc, strict=True):
        picks = [options.index(r.answer) if rng.random() < a else int(rng.integers(k)) for r in dev]
        outputs = {r.id: said(p, k) for r, p in zip(dev, picks, strict=True)}
        tiers.append(TierSpec(name, "model", outputs))
    tiers[1].agreement["choice"] = Agreement(own_temper=0.5)
    fit_agreements(tiers, dev)
    for t, a in zip(tiers, acc, strict=True):
        expected = a + (1 - a) / k  # a wrong pick lands on the right option a quarter of the time
        assert t.accuracy["choice"] == pytest.approx(expected, abs=0.06), t.name
    fitted = tiers[1].agreement["choice"]
    assert fitted.own_temper == 0.5 and "choice" not in tiers[2].agreement
    small, mid = ([rd for r in dev if (rd := t.reading(r)) is not None] for t in tiers[:2])
    assert len(small) == len(mid) == rows  # every tier answered every row
    conf = np.array([gate_confidence(tiers, 1, r, rd) for r, rd in zip(dev, mid, strict=True)])
    agree = np.array([a.answer == b.answer for a, b in zip(small, mid, strict=True)])
    assert conf[agree].mean() > conf[~agree].mean() + 0.15  # agreeing answers are surer


def test_the_eval_fit_and_its_patch_carry_the_agreement(tmp_path: Path) -> None:
    """``triage eval``'s fit (eval/cascade_report.fit) fits the accuracies and agreement before the
    thresholds, and ``--patch`` prints them as the policy's fields, which the policy takes back."""
    from eval.cascade_eval import TierSpec
    from eval.cascade_report import fit, policy_patch
    from eval.tier_outputs import Row

    rng = np.random.default_rng(3)
    options = tuple("abcd")
    dev = [
        Row(f"r{i}", "set", "dev", Question("choice", f"q{i}", options), options[rng.integers(4)], None)
        for i in range(400)
    ]
    tiers = []
    for name, a in (("small", 0.5), ("top", 0.85)):
        picks = [options.index(r.answer) if rng.random() < a else int(rng.integers(4)) for r in dev]
        tiers.append(TierSpec(name, "model", {r.id: said(p, 4) for r, p in zip(dev, picks, strict=True)}))
    for t in tiers:
        t.agreement["choice"] = Agreement(own_temper=0.0)
    fit(tiers, dev, 0.0, None, None)
    assert 0.5 < tiers[0].accuracy["choice"] < tiers[1].accuracy["choice"]
    assert "choice" in tiers[0].thresholds  # fitted on the votes' confidence
    patch = policy_patch(tmp_path / "p.yaml", tiers, [], len(dev))
    assert "      accuracy: {choice: " in patch and "      agreement:\n        choice: {temper: " in patch
    merged = patch.split("cascade:\n", 1)[1].replace(
        "    - name: small\n", "    - name: small\n      type: model\n      model: m\n"
    )
    merged = merged.replace("    - name: top\n", "    - name: top\n      type: model\n      model: m\n")
    pol = loader.parse(
        'version: 1\nbackends: {b: {type: openai, replicas: [{api_base: "http://127.0.0.1:9/v1"}]}}\n'
        "models: {m: {backend: b}}\ncascade:\n" + merged
    )
    assert (
        pol.cascade is not None
        and pol.cascade.tiers[1].agreement["choice"].temper == tiers[1].agreement["choice"].temper
    )
