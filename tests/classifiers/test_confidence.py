"""Learned gates: a tier's P(right) model, fitted, saved, loaded, and used by the cascade and the eval.

The synthetic rows make the point the model exists for: a tier as sure of its wrong answers as of
its right ones (the same top probabilities on two kinds of question, right on one kind, wrong on the
other), which only the question's embedding tells apart.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from classifiers.confidence import ConfidenceModel, confidence_name
from classifiers.training.confidence_training import fit_confidence
from eval import cascade_eval, cascade_fit
from eval.tier_outputs import Row
from policies.cascade import Gate, Question, Signals, TierAnswer, drive, steps
from policies.errors import PolicyInvalid

DIM = 8


def _direction(kind: int) -> np.ndarray:
    v = np.zeros(DIM)
    v[kind] = 1.0
    return v


def _signals(n: int, seed: int = 0) -> tuple[list[Signals], list[bool]]:
    """Half the questions of kind 0 (the tier is right 90% of the time), half of kind 1 (20%);
    the tier's top probability is drawn from the same range on both."""
    rng = np.random.default_rng(seed)
    sigs, right = [], []
    for i in range(n):
        kind = i % 2
        top = rng.uniform(0.4, 0.9)
        rest = (1 - top) / 3
        emb = _direction(kind) + rng.normal(0, 0.05, DIM)
        sigs.append(Signals("choice", (top, rest, rest, rest), embedding=emb))
        right.append(bool(rng.random() < (0.9 if kind == 0 else 0.2)))
    return sigs, right


def test_the_embedding_tells_what_the_top_probability_cannot() -> None:
    sigs, right = _signals(400)
    fitted = fit_confidence("scorer", sigs, right)
    assert fitted.model.meta["variant"] in ("neighbours", "embedding")
    assert fitted.auroc_raw < 0.6  # the tier's own confidence says next to nothing here
    assert fitted.auroc > 0.75  # out of fold: rows the model did not see
    test, truth = _signals(200, seed=1)
    p = np.array([fitted.model.p_right(s) for s in test])
    kind0 = p[::2].mean()
    kind1 = p[1::2].mean()
    assert kind0 > 0.7 and kind1 < 0.45 and kind0 - kind1 > 0.35, (kind0, kind1)  # truth: 0.9 and 0.2
    # calibrated: the mean P(right) is near the rate the rows were drawn at, (0.9 + 0.2) / 2
    assert abs(p.mean() - 0.55) < 0.08, (p.mean(), np.mean(truth))


def test_without_embeddings_only_the_scalars_are_tried() -> None:
    sigs, right = _signals(200)
    bare = [Signals(s.qtype, s.probabilities) for s in sigs]
    fitted = fit_confidence("scorer", bare, right)
    assert fitted.model.meta["variant"] == "scalars"
    assert not fitted.model.uses_embedding
    assert {v for v, _, _ in fitted.tried} == {"scalars"}
    with_embeddings = fit_confidence("scorer", sigs, right)
    assert {v for v, _, _ in with_embeddings.tried} == {"scalars", "neighbours", "embedding"}


def test_too_few_rows_or_one_class_is_refused() -> None:
    sigs, right = _signals(20)
    with pytest.raises(ValueError, match="at least 40"):
        fit_confidence("scorer", sigs, right)
    sigs, _ = _signals(100)
    with pytest.raises(ValueError, match="both right and wrong"):
        fit_confidence("scorer", sigs, [True] * 100)


def test_save_and_load_give_the_same_probabilities(tmp_path: Path) -> None:
    sigs, right = _signals(200)
    model = fit_confidence("scorer", sigs, right).model
    assert model.variant == "neighbours" and model.reference is not None  # the kinds are neighbourhoods
    model.save(tmp_path)
    assert (tmp_path / f"{confidence_name('scorer')}.npz").is_file()
    again = ConfidenceModel.load(tmp_path, "scorer")
    for s in sigs[:20]:
        assert again.p_right(s) == pytest.approx(model.p_right(s), abs=1e-6)  # the reference is kept as float32
    with pytest.raises(Exception, match="triage train"):
        ConfidenceModel.load(tmp_path, "encoder")


class _Fixed:
    """A judge that says P(right) = 0.95 for questions whose embedding points at kind 0, else 0.1."""

    uses_embedding = needs_embedding = True

    def __init__(self) -> None:
        self.seen: list[Signals] = []

    def p_right(self, s: Signals) -> float:
        self.seen.append(s)
        assert s.embedding is not None
        return 0.95 if s.embedding[0] > 0.5 else 0.1


def _two_tiers(judge: _Fixed) -> list[Gate]:
    return [
        Gate("scorer", "scorer", {"choice": 0.5}, judge=judge),
        Gate("pool", "model", {}),
    ]


def test_the_cascade_compares_the_threshold_with_the_judges_probability() -> None:
    q = Question("choice", "which?", ("a", "b", "c"))
    scores = {"scorer": TierAnswer(scores=(0.0, -3.0, -3.0)), "pool": TierAnswer(scores=(-3.0, 0.0, -3.0))}
    judge = _Fixed()
    kept = drive(steps(q, _two_tiers(judge), embedding=_direction(0)), lambda ask: scores[ask.tier])
    assert kept.tier == "scorer" and kept.confidence == pytest.approx(0.95)
    step = kept.trace[0].as_dict()
    assert step["confidence"] == pytest.approx(0.95)
    assert 0.8 < step["raw_confidence"] < 0.95  # the tier's own top probability, kept in the trace
    sent_on = drive(steps(q, _two_tiers(judge), embedding=_direction(1)), lambda ask: scores[ask.tier])
    assert sent_on.tier == "pool" and sent_on.answer == "b"
    assert sent_on.trace[0].outcome == "escalated" and sent_on.trace[0].confidence == pytest.approx(0.1)
    # the pool tier had no judge: its own confidence, no raw_confidence in its step
    assert "raw_confidence" not in sent_on.trace[1].as_dict()


def test_no_judge_for_a_task_head_numbers_or_a_missing_embedding() -> None:
    judge = _Fixed()
    gates = _two_tiers(judge)
    answer = TierAnswer(scores=(0.0, -3.0))
    task_q = Question("choice", "book a flight", ("book", "cancel"), task="intents")
    encoder = [Gate("encoder", "encoder", {"choice": 0.5}, judge=judge), Gate("pool", "model", {})]
    d = drive(steps(task_q, encoder, embedding=_direction(1)), lambda ask: answer)
    assert d.tier == "encoder" and "raw_confidence" not in d.trace[0].as_dict()  # the task head's own probability
    plain = Question("choice", "which?", ("a", "b"))
    d = drive(steps(plain, gates, embedding=None), lambda ask: answer)
    assert d.tier == "scorer" and "raw_confidence" not in d.trace[0].as_dict()
    assert judge.seen == []
    # a scorer tier reads a task's question like any other choice question: its judge applies
    d = drive(steps(task_q, gates, embedding=_direction(1)), lambda ask: answer)
    assert d.tier == "pool" and d.trace[0].raw_confidence is not None and len(judge.seen) == 1


def _rows(n: int, split: str, seed: int) -> list[Row]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = i % 2
        emb = _direction(kind) + rng.normal(0, 0.05, DIM)
        q = Question("choice", f"question {i} of kind {kind}", ("a", "b", "c", "d"))
        out.append(Row(f"{split}-{i}", "synthetic", split, q, "a", None, embedding=emb))
    return out


def _outputs(rows: list[Row], seed: int) -> tuple[dict[str, TierAnswer], dict[str, TierAnswer]]:
    """A cheap tier right on 95% of kind 0 and 15% of kind 1, equally sure of both; a top tier
    right on 70% of everything."""
    rng = np.random.default_rng(seed)
    cheap, top = {}, {}
    for i, r in enumerate(rows):
        kind = i % 2
        pick = 0 if rng.random() < (0.95 if kind == 0 else 0.15) else int(rng.integers(1, 4))
        margin = rng.uniform(1.0, 3.0)
        cheap[r.id] = TierAnswer(scores=tuple(margin if j == pick else 0.0 for j in range(4)))
        best = 0 if rng.random() < 0.7 else int(rng.integers(1, 4))
        top[r.id] = TierAnswer(scores=tuple(0.0 if j == best else -30.0 for j in range(4)))
    return cheap, top


@pytest.mark.parametrize("gate", ["confidence", "learned"])
def test_eval_fits_the_gate_and_a_learned_one_keeps_quality_at_a_third_of_the_escalation(gate: str) -> None:
    dev, test = _rows(400, "dev", 0), _rows(400, "test", 1)
    cheap, top = _outputs(dev + test, 2)
    tiers = [
        cascade_eval.TierSpec("scorer", "scorer", cheap, gate_kind=gate),
        cascade_eval.TierSpec("top", "recorded", top),
    ]
    cascade_fit.fit_temperatures(tiers[0], dev)
    cascade_eval.fit_judges(tiers, dev)
    assert tiers[0].judge is not None and tiers[0].judge_fit["variant"] in ("neighbours", "embedding")
    cascade_fit.fit_thresholds(tiers, dev)
    [report] = cascade_eval.evaluate(tiers, test)
    assert report.auroc_learned["scorer"] > report.auroc_raw["scorer"] + 0.2
    assert report.ece_learned["scorer"] < 0.1
    # the default fit: the lowest threshold at which what the cheap tier keeps is as right as the top
    # tier would be on it. Learned (measured 0.71 at 23% escalated): the cheap tier keeps kind 0 and
    # enough of the rest to break even; its own confidence (0.66 at 65%) cannot tell the kinds apart.
    top_alone = report.alone["top"]
    if gate == "learned":
        assert report.cascade >= top_alone - 0.02
        assert report.past_first < 0.35
    else:
        assert report.cascade < top_alone - 0.02 or report.past_first > 0.5
    table = cascade_eval.gate_table(tiers, test)
    assert {(g["tier"], g["type"]) for g in table} == {("scorer", "all"), ("scorer", "choice")}
    pooled = cascade_eval.pooled([report])
    assert pooled["always_top"] == pytest.approx(report.alone["top"])
    assert math.isclose(pooled["reached_top"], report.share["top"] + report.failed / report.n)


def test_a_learned_gate_without_its_model_stops_the_start(tmp_path: Path) -> None:
    from gateway.service.assemble import load_judges
    from policies.schema import Policy

    policy = Policy.model_validate(
        {
            "version": 1,
            "backends": {"s": {"type": "scripted"}},
            "models": {"m": {"backend": "s"}},
            "cascade": {
                "artifacts": "gates",
                "tiers": [
                    {"name": "scorer", "type": "model", "model": "m", "gate": "learned", "thresholds": {"choice": 0.5}},
                    {"name": "pool", "type": "model", "model": "m"},
                ],
            },
        }
    )
    with pytest.raises(PolicyInvalid, match=r"confidence-scorer\.json is missing: run `triage train"):
        load_judges(policy, tmp_path)
    sigs, right = _signals(100)
    bare = [Signals(s.qtype, s.probabilities) for s in sigs]
    fit_confidence("scorer", bare, right).model.save(tmp_path / "gates")
    assert set(load_judges(policy, tmp_path)) == {"scorer"}


def _constant(tier: str, p: float) -> ConfidenceModel:
    """A confidence model that says ``p`` whatever it reads (its weights are zero)."""
    from classifiers.confidence import SCALARS

    k = len(SCALARS)
    return ConfidenceModel(tier, np.zeros(k), math.log(p / (1 - p)), np.zeros(k), np.ones(k), "scalars")


GATED = """version: 1
backends:
  cheap: {type: scripted, text: "B"}
  dear: {type: scripted, text: "C"}
models:
  cheap: {backend: cheap}
  dear: {backend: dear}
cascade:
  artifacts: gates
  tiers:
    - {name: first, type: model, model: cheap, logprobs: false, assumed_confidence: 0.6, gate: learned,
       thresholds: {choice: 0.95}}
    - {name: last, type: model, model: dear, logprobs: false}
"""


def test_the_gateway_gates_on_the_learned_probability(gateway, tmp_path: Path) -> None:
    _constant("first", 0.9).save(tmp_path / "gates")
    gw = gateway(GATED)
    with gw.http() as client:
        q = {"question": "which?", "type": "choice", "options": ["a", "b", "c"]}
        r = client.post("/v1/decide", json=q)
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["tier"] == "last" and d["answer"] == "c"
        first = d["trace"][0]
        assert first["outcome"] == "escalated"
        assert first["confidence"] == pytest.approx(0.9)  # the learned P(right), compared with 0.95
        assert first["raw_confidence"] == pytest.approx(0.6)  # the tier's own (assumed) confidence
        # the same question with the threshold under the learned probability: kept at the first tier
        low = client.post("/v1/decide", json={**q, "policy_overrides": {"thresholds": {"first": {"choice": 0.85}}}})
        assert low.json()["tier"] == "first" and low.json()["confidence"] == pytest.approx(0.9)


def test_a_gate_fitted_at_other_temperatures_stops_the_start(tmp_path: Path) -> None:
    from gateway.service.assemble import load_judges
    from policies.loader import load

    model = _constant("first", 0.9)
    model.meta["temperature"] = {"choice": 2.0}
    model.save(tmp_path / "gates")
    (tmp_path / "p.yaml").write_text(GATED)
    with pytest.raises(PolicyInvalid, match="fitted at temperature"):
        load_judges(load(tmp_path / "p.yaml"), tmp_path)


def test_the_of_top_target_escalates_least_while_keeping_the_share() -> None:
    dev, test = _rows(400, "dev", 0), _rows(400, "test", 1)
    cheap, top = _outputs(dev + test, 2)
    tiers = [
        cascade_eval.TierSpec("scorer", "scorer", cheap, gate_kind="learned"),
        cascade_eval.TierSpec("top", "recorded", top),
    ]
    cascade_fit.fit_temperatures(tiers[0], dev)
    cascade_eval.fit_judges(tiers, dev)
    cascade_fit.fit_for_share_of_top(tiers, dev, 0.97)
    t = tiers[0].thresholds["choice"]
    assert set(tiers[0].thresholds.values()) == {t}  # one threshold, every type
    on_dev = cascade_eval.pooled(cascade_eval.evaluate(tiers, dev, curves=False))
    assert on_dev["of_top"] >= 0.97 and on_dev["reached_top"] < 0.7
    lower = max(0.0, t - 0.05)  # any lower threshold breaks the share (or escalates no less)
    cascade_fit._set_all(tiers, dev, lower)
    below = cascade_eval.pooled(cascade_eval.evaluate(tiers, dev, curves=False))
    assert below["of_top"] < 0.97 or below["reached_top"] >= on_dev["reached_top"]


class _Versus(_Fixed):
    """A judge that also knows how the tier after it does: kind 0 questions are right 0.6 of the
    time here and 0.9 after escalating (BoolQ at the encoder, say); kind 1, 0.95 here and 0.7 after."""

    def p_right(self, s: Signals) -> float:
        assert s.embedding is not None
        return 0.6 if s.embedding[0] > 0.5 else 0.95

    def p_after(self, s: Signals) -> float | None:
        assert s.embedding is not None
        return 0.9 if s.embedding[0] > 0.5 else 0.7


def test_an_escalation_margin_sends_on_what_escalating_does_better() -> None:
    q = Question("choice", "which?", ("a", "b", "c"))
    scores = {"scorer": TierAnswer(scores=(0.0, -3.0, -3.0)), "pool": TierAnswer(scores=(-3.0, 0.0, -3.0))}

    def tiers(margin: float | None) -> list[Gate]:
        return [
            Gate("scorer", "scorer", {"choice": 0.5}, judge=_Versus(), escalation_margin=margin),
            Gate("pool", "model", {}),
        ]

    # a threshold alone keeps the kind-0 answer (0.6 >= 0.5) ...
    alone = drive(steps(q, tiers(None), embedding=_direction(0)), lambda ask: scores[ask.tier])
    assert alone.tier == "scorer" and "escalation_p_right" not in alone.trace[0].as_dict()
    # ... with a margin it goes where it is likelier right, and the trace says what it was compared with
    sent = drive(steps(q, tiers(0.05), embedding=_direction(0)), lambda ask: scores[ask.tier])
    assert sent.tier == "pool" and sent.trace[0].as_dict()["escalation_p_right"] == pytest.approx(0.9)
    kept = drive(steps(q, tiers(0.05), embedding=_direction(1)), lambda ask: scores[ask.tier])
    assert kept.tier == "scorer" and kept.trace[0].as_dict()["escalation_p_right"] == pytest.approx(0.7)
    # within the margin counts as no worse
    assert drive(steps(q, tiers(0.35), embedding=_direction(0)), lambda ask: scores[ask.tier]).tier == "scorer"


def _versus_outputs(rows: list[Row], seed: int) -> tuple[dict[str, TierAnswer], dict[str, TierAnswer]]:
    """A cheap tier right on 60% of kind 0 and 95% of kind 1, a top tier right on 90% and 70%."""
    rng = np.random.default_rng(seed)
    cheap, top = {}, {}
    for i, r in enumerate(rows):
        kind = i % 2
        for out, p in ((cheap, (0.6, 0.95)[kind]), (top, (0.9, 0.7)[kind])):
            pick = 0 if rng.random() < p else int(rng.integers(1, 4))
            out[r.id] = TierAnswer(scores=tuple(2.0 if j == pick else 0.0 for j in range(4)))
    return cheap, top


def test_the_eval_fits_what_escalating_gets_and_the_margin_uses_it(tmp_path: Path) -> None:
    dev, test = _rows(400, "dev", 0), _rows(400, "test", 1)
    cheap, top = _versus_outputs(dev + test, 3)
    results = {}
    for margin in (None, 0.02):
        tiers = [
            cascade_eval.TierSpec("scorer", "scorer", cheap, gate_kind="learned", escalation_margin=margin),
            cascade_eval.TierSpec("top", "recorded", top),
        ]
        cascade_eval.fit_judges(tiers, dev)
        judge = tiers[0].judge
        assert judge is not None and judge.after is not None and judge.uses_embedding
        tiers[0].thresholds = {"choice": 0.5}
        [results[margin]] = cascade_eval.evaluate(tiers, test)
    # a threshold alone keeps nearly everything (the tier is right 0.6 or more on both kinds);
    # the margin sends kind 0 on, where the top tier does better: above both tiers alone
    assert results[None].past_first < 0.2
    assert 0.35 < results[0.02].past_first < 0.65
    assert results[0.02].cascade > max(results[0.02].alone.values()) + 0.05
    assert results[0.02].cascade > results[None].cascade + 0.05  # measured 0.87 against 0.79
    judge.save(tmp_path)
    again = ConfidenceModel.load(tmp_path, "scorer")
    s = Signals("choice", (0.7, 0.1, 0.1, 0.1), embedding=_direction(0))
    assert again.p_after(s) == pytest.approx(judge.p_after(s), abs=1e-5) and again.p_after(s) > 0.8


def test_an_escalation_margin_needs_a_learned_gate_and_reaches_the_gateways_gates() -> None:
    from pydantic import ValidationError

    from gateway.service.decisions import gates
    from policies.schema import Policy

    def policy(gate: str) -> Policy:
        tier = {"name": "first", "type": "model", "model": "m", "gate": gate, "escalation_margin": 0.02}
        return Policy.model_validate(
            {
                "version": 1,
                "backends": {"s": {"type": "scripted"}},
                "models": {"m": {"backend": "s"}},
                "cascade": {"tiers": [tier, {"name": "last", "type": "model", "model": "m"}]},
            }
        )

    with pytest.raises(ValidationError, match=r"escalation_margin .* needs gate: learned"):
        policy("confidence")
    spec = policy("learned").cascade
    assert spec is not None
    assert [g.escalation_margin for g in gates(spec, None)] == [0.02, None]


def test_each_question_type_with_enough_rows_gets_its_own_calibration(tmp_path: Path) -> None:
    """Yes/no answers are right more often than choice answers at the same top probability: one
    Platt calibration for both is off for each; one per type is not."""
    rng = np.random.default_rng(4)
    sigs, right = [], []
    for i in range(600):
        top = rng.uniform(0.5, 0.95)
        if i % 2:
            sigs.append(Signals("yes_no", (top, 1 - top)))
            right.append(bool(rng.random() < min(1.0, top + 0.1)))
        else:
            rest = (1 - top) / 3
            sigs.append(Signals("choice", (top, rest, rest, rest)))
            right.append(bool(rng.random() < top - 0.3))
    fitted = fit_confidence("scorer", sigs, right)
    assert set(fitted.model.platt_by_type) == {"choice", "yes_no"}
    y = np.array(right)
    for qtype in ("choice", "yes_no"):
        m = np.array([s.qtype == qtype for s in sigs])
        assert abs(fitted.out_of_fold[m].mean() - y[m].mean()) < 0.03  # calibrated in the mean, per type
    fitted.model.save(tmp_path)
    again = ConfidenceModel.load(tmp_path, "scorer")
    assert set(again.platt_by_type) == {"choice", "yes_no"}
    assert again.p_right(sigs[1]) == pytest.approx(fitted.model.p_right(sigs[1]))
    few = fit_confidence("scorer", sigs[:60] + [Signals("score", (0.6, 0.4))] * 10, right[:60] + [True, False] * 5)
    assert "score" not in few.model.platt_by_type  # 10 rows: the pooled calibration serves it


def test_a_scalar_gate_that_keeps_a_record_of_escalating_still_judges_without_an_embedding(tmp_path: Path) -> None:
    from dataclasses import replace

    from gateway.service.assemble import load_judges
    from policies.cascade import judged, read

    sigs, right = _signals(200)
    bare = [Signals(s.qtype, s.probabilities, embedding=s.embedding) for s in sigs]
    model = fit_confidence("first", [Signals(s.qtype, s.probabilities) for s in bare], right).model
    model = replace(model, reference=np.vstack([s.embedding for s in bare]), after=np.ones(len(bare)))
    assert model.uses_embedding and not model.needs_embedding
    q = Question("choice", "which?", ("a", "b", "c"))
    gate = Gate("first", "model", {"choice": 0.5}, judge=model, escalation_margin=0.02)
    reading = read(q, gate, TierAnswer(scores=(0.0, -3.0, -3.0)))
    assert judged(q, gate, reading, None, None) is not None  # P(right) needs no embedding
    # a margin where the policy has no classifier to embed the question could never act: refused
    model.save(tmp_path / "gates")
    from policies.loader import load

    (tmp_path / "p.yaml").write_text(GATED.replace("gate: learned,", "gate: learned, escalation_margin: 0.02,"))
    with pytest.raises(PolicyInvalid, match="escalation_margin compares"):
        load_judges(load(tmp_path / "p.yaml"), tmp_path)
