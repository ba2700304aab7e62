"""The served pool (issue 56): ``policies/examples/cascade_pool.yaml``'s three-tier typed cascade
with agreement as its tiers' confidence, replayed through the gateway's own code
(``gateway.service.decisions.gates`` -> ``policies.cascade.steps``) over MMLU-Pro's recorded answers
of its three models, on the test rows. Each model's answer reaches the cascade as a served model
tier's would without log-probabilities (its letter at the tier's assumed confidence).

With ``--fit`` the policy's numbers are fitted first, on dev rows only, and printed as its cascade
section: each tier's accuracy and agreement by ``triage eval``'s fit (``eval/agreement_fit.py``),
then the one threshold of every tier but the last at the least dev cost whose dev accuracy, served,
reaches the top model's there.

``python -m benchmarks pool-served [--fit]``; a JSON report in ``out/``."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from rich.console import Console

from benchmarks.pool import FIT_KNOBS, KNOBS, THRESHOLDS
from benchmarks.pool_data import Recorded, mmlu_pro
from benchmarks.report import save
from eval.agreement_fit import fit_agreements
from eval.cascade_eval import TierSpec
from eval.pool_fit import fit_agreement
from eval.tier_outputs import Row
from gateway.service.decisions import gates
from policies.answers import assumed_scores
from policies.cascade import Ask, CascadeExhausted, Gate, Question, TierAnswer, drive
from policies.cascade_routing import Routing, steps_for
from policies.loader import load
from policies.pool import NO_ANSWER, Agreement
from policies.tiers import ModelTier

BOOTSTRAP = 200


def _answer(recorded: int, k: int, assumed: float) -> TierAnswer:
    if recorded == NO_ANSWER:
        return TierAnswer(error="no answer recorded")
    return TierAnswer(tuple(assumed_scores(k, recorded, assumed)), assumed=True)


def _rows(t: Recorded, split: str) -> list[Row]:
    return [
        Row(rid, "mmlu_pro", split, Question("choice", text, opts), opts[g], cat)
        for rid, text, opts, g, cat in zip(
            t.labels.ids, t.labels.texts, t.options, t.gold, t.labels.categories, strict=True
        )
    ]


def fit(dev: Recorded, cols: list[int], tiers: list[ModelTier]) -> tuple[list[TierSpec], dict[str, Any]]:
    """Each tier's accuracy and agreement by ``triage eval``'s fit on dev rows; then the one threshold
    of every tier at the least dev cost whose dev accuracy, served, reaches the top tier's there."""
    rows = _rows(dev, "dev")
    specs = []
    for tier, c in zip(tiers, cols, strict=True):
        outputs = {
            r.id: _answer(int(a), len(r.question.options), tier.assumed_confidence)
            for r, a in zip(rows, dev.answers[:, c], strict=True)
        }
        specs.append(TierSpec(tier.name, "model", outputs, agreement={"choice": Agreement(own_temper=0.0)}))
    fit_agreements(specs, rows)
    target = float((dev.answers[:, cols[-1]] == dev.gold).mean())
    best: tuple[float, float, float] | None = None  # (cost, accuracy, threshold)
    for th in THRESHOLDS:
        for s in specs[:-1]:
            s.thresholds = {"choice": float(th)}
        right, cost, _, _ = replay(dev, cols, [s.gate() for s in specs], tiers, "best")
        if right.mean() >= target and (best is None or cost.mean() < best[0]):
            best = (float(cost.mean()), float(right.mean()), float(th))
    th = best[2] if best is not None else 1.01
    for s in specs[:-1]:
        s.thresholds = {"choice": th}
    return specs, {"dev_top_accuracy": target, "dev_accuracy": best[1] if best else None, "threshold": th}


def replay(
    t: Recorded,
    cols: list[int],
    served: list[Gate],
    tiers: list[ModelTier],
    on_exhausted: Literal["error", "best"],
    routing: Routing | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """The served decision on every row: (right, cost, calls, the tier that answered)."""
    by_name = {tier.name: (tier, c) for tier, c in zip(tiers, cols, strict=True)}
    right, cost, calls, who = [], [], [], []
    for r, opts in enumerate(t.options):
        asked: list[str] = []

        def answer_for(ask: Ask, r: int = r, k: int = len(opts), asked: list[str] = asked) -> TierAnswer:
            asked.append(ask.tier)
            tier, c = by_name[ask.tier]
            return _answer(int(t.answers[r, c]), k, tier.assumed_confidence)

        try:
            q = Question("choice", t.labels.texts[r], opts)
            d = drive(steps_for(q, served, on_exhausted, routing=routing), answer_for)
            right.append(float(d.answer == opts[t.gold[r]]))
            who.append(d.tier)
        except CascadeExhausted:
            right.append(0.0)
            who.append("-")
        cost.append(sum(float(t.cost[r, by_name[n][1]]) for n in asked))
        calls.append(float(len(asked)))
    return np.array(right), np.array(cost), np.array(calls), who


def measured(t: Recorded, top: int, out: tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]) -> dict[str, Any]:
    """Accuracy and cost against the top model alone on the same rows, bootstrap SEs."""
    right, cost, calls, who = out
    top_right = (t.answers[:, top] == t.gold).astype(np.float64)
    draws = np.random.default_rng(56).integers(0, len(right), (BOOTSTRAP, len(right)))
    share = cost[draws].mean(axis=1) / t.cost[draws, top].mean(axis=1)
    diff = right[draws].mean(axis=1) - top_right[draws].mean(axis=1)
    return {
        "rows": len(right),
        "accuracy": float(right.mean()),
        "accuracy_se": float(right.std() / np.sqrt(len(right))),
        "top_accuracy": float(top_right.mean()),
        "difference_se": float(diff.std()),
        "cost_share_of_top": float(cost.mean() / t.cost[:, top].mean()),
        "cost_share_se": float(share.std()),
        "calls_per_question": float(calls.mean()),
        "answered_by": {n: who.count(n) / len(who) for n in sorted(set(who))},
    }


def fit_routing(dev: Recorded, cols: list[int], served: list[Gate], tiers: list[ModelTier]) -> dict[str, Any]:
    """The routing's agreement (``eval/pool_fit.fit_agreement``, the tiers' accuracies as priors) and
    its knob: the least dev cost, served, at which the dev accuracy reaches the top tier's there."""
    acc = np.array([g.accuracy["choice"] for g in served])
    sub = dev.answers[:, cols]
    ag = fit_agreement(sub, np.tile(acc, (len(sub), 1)), dev.gold, dev.k, dev.cost[:, cols], FIT_KNOBS)
    target = float((sub[:, -1] == dev.gold).mean())
    best: tuple[float, float, float] | None = None  # (cost, accuracy, knob)
    for knob in KNOBS:
        right, cost, _, _ = replay(dev, cols, served, tiers, "error", Routing(float(knob), {"choice": ag}))
        if right.mean() >= target and (best is None or cost.mean() < best[0]):
            best = (float(cost.mean()), float(right.mean()), float(knob))
    knob = best[2] if best is not None else float(KNOBS[0])
    return {"agreement": ag, "knob": knob, "dev_accuracy": best[1] if best else None, "dev_top_accuracy": target}


def run(policy: Path, router_policy: Path, router: str, refit: bool, routing: bool, out: Path) -> dict[str, Any]:
    console = Console(highlight=False)
    started = time.perf_counter()
    data = mmlu_pro(router_policy, router)
    dev, test = data.split("dev"), data.split("test")
    spec = load(policy).cascade
    assert spec is not None
    tiers = [t for t in spec.tiers if isinstance(t, ModelTier)]
    cols = [data.models.index(t.model) for t in tiers]
    report: dict[str, Any] = {"policy": str(policy), "tiers": {t.name: t.model for t in tiers}}
    served = gates(spec, None)
    if refit:
        specs, dev_fit = fit(dev, cols, tiers)
        served = [
            dataclasses.replace(s.gate(), per_call=g.per_call, per_1k_tokens=g.per_1k_tokens)
            for s, g in zip(specs, served, strict=True)
        ]
        report["fitted"] = {
            **dev_fit,
            "tiers": {s.name: {"accuracy": s.accuracy, "agreement": s.agreement["choice"].to_json()} for s in specs},
        }
        console.print(f"fitted on {len(dev.gold)} dev rows: the policy's numbers (threshold {dev_fit['threshold']:g}):")
        for s in specs:
            ag = ", ".join(f"{k}: {round(v, 4):g}" for k, v in s.agreement["choice"].to_json().items())
            console.print(f"  {s.name}: accuracy {{choice: {s.accuracy['choice']:g}}}, agreement {{choice: {{{ag}}}}}")
    top = cols[-1]
    report["test"] = measured(test, top, replay(test, cols, served, tiers, spec.on_exhausted))
    lines = [("the chain, tier after tier", report["test"])]
    if routing:
        fitted = fit_routing(dev, cols, served, tiers)
        rule = Routing(fitted["knob"], {"choice": fitted["agreement"]})
        report["routed"] = {
            **{k: v for k, v in fitted.items() if k != "agreement"},
            "agreement": fitted["agreement"].to_json(),
            "test": measured(test, top, replay(test, cols, served, tiers, "error", rule)),
        }
        ag = ", ".join(f"{k}: {round(v, 4):g}" for k, v in fitted["agreement"].to_json().items() if k != "own_temper")
        console.print(f"routing fitted on dev rows: knob {fitted['knob']:g}, agreement {{choice: {{{ag}}}}}")
        lines.append((f"routed (knob {fitted['knob']:g})", report["routed"]["test"]))
    report["seconds"] = round(time.perf_counter() - started, 1)
    for name, t in lines:
        console.print(
            f"{name}, on {t['rows']} test rows: accuracy {t['accuracy']:.4f} (SE {t['accuracy_se']:.4f}) against "
            f"{data.models[top]} alone {t['top_accuracy']:.4f} (SE of the difference {t['difference_se']:.4f}), at "
            f"{t['cost_share_of_top']:.1%} of its cost (SE {t['cost_share_se']:.1%}), "
            f"{t['calls_per_question']:.2f} calls a question; answered by "
            + ", ".join(f"{n} {v:.0%}" for n, v in t["answered_by"].items())
        )
    save(console, out, report)
    return report
