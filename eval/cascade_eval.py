"""The cascade on labeled typed rows: each tier alone, the cascade at fitted thresholds, and the
share of questions each tier answered. Tier outputs come from :mod:`eval.tier_outputs` (computed
once, cached); the cascade itself is ``policies.cascade.run``, the same generator the gateway drives.

Fitting, on ``dev`` rows only: each tier's temperature per question type (negative log-likelihood),
then for each tier but the last, per type, the lowest threshold at which the questions it would
keep are answered at least as well by it as by the last tier (less ``slack``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from classifiers.calibration import ece, fit_temperature
from eval.sweep import Curve, curve
from eval.tier_outputs import Row
from policies.answers import same_number
from policies.cascade import Ask, CascadeExhausted, Gate, TierAnswer, drive, read, run

Outputs = Mapping[str, TierAnswer]  # row id -> the tier's answer
GRID = tuple(round(x, 3) for x in np.linspace(0.0, 1.0, 101))


@dataclass
class TierSpec:
    name: str
    kind: str
    outputs: Outputs
    temperatures: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    per_call: float = 0.0
    per_1k_tokens: float = 0.0

    def cost(self, answer: TierAnswer) -> float:
        tokens = sum(v for k, v in (answer.usage or {}).items() if k in ("prompt_tokens", "completion_tokens"))
        return self.per_call + self.per_1k_tokens * tokens / 1000

    def gate(self) -> Gate:
        return Gate(self.name, self.kind, dict(self.thresholds), {}, dict(self.temperatures))


def right(row: Row, answer: str) -> bool:
    """Numbers are compared as numbers (``policies.answers.same_number``), options as text."""
    return same_number(answer, row.answer) if row.question.numeric else answer == row.answer


def _usable(rows: Sequence[Row], outputs: Outputs) -> list[Row]:
    return [r for r in rows if (a := outputs.get(r.id)) is not None and (a.scores is not None or a.text is not None)]


def fit_temperatures(tier: TierSpec, dev: Sequence[Row]) -> None:
    by_type: dict[str, list[Row]] = defaultdict(list)
    for r in _usable(dev, tier.outputs):
        if not r.question.numeric:
            by_type[r.question.type].append(r)
    for qtype, rows in by_type.items():
        if len(rows) < 20:
            continue
        width = max(len(r.question.options) for r in rows)
        logits = np.full((len(rows), width), -1e4)
        y = np.zeros(len(rows), dtype=int)
        for i, r in enumerate(rows):
            scores = tier.outputs[r.id].scores or ()
            logits[i, : len(scores)] = scores
            y[i] = r.question.options.index(r.answer)
        tier.temperatures[qtype] = round(fit_temperature(logits, y), 4)


def fit_thresholds(
    tiers: Sequence[TierSpec], dev: Sequence[Row], slack: float = 0.0, target: tuple[str, float] | None = None
) -> None:
    """Per type, for each tier but the last, the lowest threshold such that:
    - no target: the questions the tier keeps are answered at least as well by it as by the last
      tier that answered them (less ``slack``);
    - ``("accuracy", x)``: the questions it keeps are answered right at least ``x`` of the time;
    - ``("escalation", x)``: (first tier) at most ``x`` of the questions go past it; later tiers
      as with no target."""
    for i, tier in enumerate(tiers[:-1]):
        by_type: dict[str, list[tuple[float, bool, bool]]] = defaultdict(list)
        for r in dev:
            later = [t for t in tiers[i + 1 :] if (o := t.outputs.get(r.id)) is not None and o.scores is not None]
            a = tier.outputs.get(r.id)
            if a is None or a.scores is None or not later or r.question.numeric:
                continue
            top, b = later[-1], later[-1].outputs[r.id]
            mine = read(r.question, tier.gate(), a)
            theirs = read(r.question, top.gate(), b)
            by_type[r.question.type].append((mine.confidence, mine.answer == r.answer, theirs.answer == r.answer))
        for qtype, points in by_type.items():
            if target is not None and target[0] == "accuracy":
                tier.thresholds[qtype] = _lowest_at_least(points, target[1])
            elif target is not None and target[0] == "escalation" and i == 0:
                confidences = sorted(c for c, _, _ in points)
                k = min(int(target[1] * len(confidences)), len(confidences) - 1)
                tier.thresholds[qtype] = float(confidences[k])  # about a share x falls below it
            else:
                tier.thresholds[qtype] = _lowest_safe(points, slack)


def fit_for_cost(tiers: Sequence[TierSpec], dev: Sequence[Row], budget: float) -> None:
    """``--target cost=X``: one threshold for every tier but the last (on each one's own scale),
    the one with the best accuracy on dev rows at a mean cost per question of at most ``budget``
    (the cheapest, when none is within it)."""
    best: tuple[float, float, float] | None = None  # (accuracy, -cost, threshold)
    cheapest: tuple[float, float] | None = None  # (cost, threshold)
    for t in GRID:
        for tier in tiers[:-1]:
            tier.thresholds = {q: float(t) for q in ("choice", "yes_no", "score")}
        reports = evaluate(tiers, dev, curves=False)
        n = sum(r.n for r in reports) or 1
        cost = sum(r.cost_per_question * r.n for r in reports) / n
        accuracy = sum(r.cascade * r.n for r in reports) / n
        if cheapest is None or cost < cheapest[0]:
            cheapest = (cost, float(t))
        if cost <= budget and (best is None or (accuracy, -cost) > best[:2]):
            best = (accuracy, -cost, float(t))
    chosen = best[2] if best is not None else (cheapest[1] if cheapest is not None else 1.0)
    for tier in tiers[:-1]:
        tier.thresholds = {q: chosen for q in ("choice", "yes_no", "score")}


def _lowest_at_least(points: list[tuple[float, bool, bool]], accuracy: float, min_kept: int = 10) -> float:
    for t in GRID:
        kept = [m for c, m, _ in points if c >= t]
        if len(kept) < min_kept:
            break
        if np.mean(kept) >= accuracy:
            return float(t)
    return 1.0


def _lowest_safe(points: list[tuple[float, bool, bool]], slack: float, min_kept: int = 10) -> float:
    for t in GRID:
        kept = [(m, o) for c, m, o in points if c >= t]
        if len(kept) < min_kept:
            break
        if np.mean([m for m, _ in kept]) >= np.mean([o for _, o in kept]) - slack:
            return float(t)
    return 1.0


@dataclass
class SetReport:
    source: str
    qtype: str
    n: int
    alone: dict[str, float]  # tier -> accuracy answering everything itself
    ece: dict[str, float]  # tier -> ECE of its top-option probability (after temperature)
    latency_ms: dict[str, float]  # tier -> mean per question
    ece_raw: dict[str, float] = field(default_factory=dict)  # the same at temperature 1 (before calibration)
    brier: dict[str, float] = field(default_factory=dict)  # tier -> Brier score over the options (after)
    brier_raw: dict[str, float] = field(default_factory=dict)  # the same at temperature 1
    latency_p50_ms: dict[str, float] = field(default_factory=dict)
    latency_p99_ms: dict[str, float] = field(default_factory=dict)
    cascade: float = math.nan
    share: dict[str, float] = field(default_factory=dict)  # tier -> share of questions it answered in the cascade
    past_first: float = math.nan  # share escalated past the first tier
    failed: int = 0
    tiers: list[str] = field(default_factory=list)
    curve: Curve = field(default_factory=Curve)
    cost_per_question: float = math.nan  # through the cascade: every tier asked, at its prices
    cost_top_per_question: float = math.nan  # asking the last tier alone
    by_category: dict[str, dict[str, float]] = field(default_factory=dict)  # accuracy, past_first, n


def evaluate(tiers: Sequence[TierSpec], rows: Sequence[Row], curves: bool = True) -> list[SetReport]:
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.source, r.question.type)].append(r)
    return [_one_set(tiers, src, qtype, group, curves) for (src, qtype), group in sorted(groups.items())]


def _one_set(tiers: Sequence[TierSpec], source: str, qtype: str, rows: Sequence[Row], curves: bool = True) -> SetReport:
    tiers = [t for t in tiers if any(r.id in t.outputs for r in rows)]  # a recorded tier covers some sets only
    rows = [r for r in rows if all(r.id in t.outputs for t in tiers)]
    report = SetReport(source, qtype, len(rows), {}, {}, {})
    for t in tiers:
        _measure_tier(report, t, rows)
    gates = [t.gate() for t in tiers]
    by_name = {t.name: t for t in tiers}
    wins, answered_by, failed, cost = 0, defaultdict(int), 0, 0.0
    categories: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
    for r in rows:
        asked: list[str] = []

        def answer_for(ask: Ask, r: Row = r, asked: list[str] = asked) -> TierAnswer:
            asked.append(ask.tier)
            return by_name[ask.tier].outputs[r.id]

        try:
            d = drive(run(r.question, gates), answer_for)
            ok, past = right(r, d.answer), d.tier != tiers[0].name
            wins += ok
            answered_by[d.tier] += 1
        except CascadeExhausted:  # counted as a miss, never as a guess
            failed, ok, past = failed + 1, False, True
        cost += sum(by_name[t].cost(by_name[t].outputs[r.id]) for t in asked)
        categories[r.category or "-"].append((ok, past))
    n = len(rows)
    if n:
        report.cost_per_question = cost / n
        report.cost_top_per_question = sum(tiers[-1].cost(tiers[-1].outputs[r.id]) for r in rows) / n
    report.by_category = {
        c: {
            "n": len(v),
            "accuracy": float(np.mean([ok for ok, _ in v])),
            "past_first": float(np.mean([p for _, p in v])),
        }
        for c, v in sorted(categories.items())
    }
    share = {t.name: answered_by[t.name] / n if n else 0.0 for t in tiers}
    report.cascade, report.share, report.failed = wins / n if n else math.nan, share, failed
    report.past_first, report.tiers = 1.0 - share[tiers[0].name], [t.name for t in tiers]
    if curves:
        report.curve = curve(gates, [t.outputs for t in tiers], rows, right)
    return report


def _brier(readings: Sequence[Any], rows: Sequence[Row]) -> float:
    scores = [
        sum((p - (o == r.answer)) ** 2 for o, p in rd.probabilities.items())
        for rd, r in zip(readings, rows, strict=True)
        if not r.question.numeric
    ]
    return float(np.mean(scores)) if scores else math.nan


def _measure_tier(report: SetReport, t: TierSpec, rows: Sequence[Row]) -> None:
    """One tier answering every row itself: accuracy, calibration before and after, latency."""
    usable = _usable(rows, t.outputs)
    raw_gate = Gate(t.name, t.kind)
    after = [read(r.question, t.gate(), t.outputs[r.id]) for r in usable]
    before = [read(r.question, raw_gate, t.outputs[r.id]) for r in usable]
    correct = np.array([right(r, rd.answer) for rd, r in zip(after, usable, strict=True)], dtype=float)
    nan = math.nan
    report.alone[t.name] = float(correct.mean()) if len(correct) else nan
    report.ece[t.name] = ece(np.array([max(rd.probabilities.values()) for rd in after]), correct) if usable else nan
    report.ece_raw[t.name] = (
        ece(
            np.array([max(rd.probabilities.values()) for rd in before]),
            np.array([right(r, rd.answer) for rd, r in zip(before, usable, strict=True)], dtype=float),
        )
        if usable
        else nan
    )
    report.brier[t.name] = _brier(after, usable)
    report.brier_raw[t.name] = _brier(before, usable)
    ms = np.array([t.outputs[r.id].latency_ms for r in rows])
    report.latency_ms[t.name] = float(ms.mean()) if len(ms) else nan
    report.latency_p50_ms[t.name] = float(np.percentile(ms, 50)) if len(ms) else nan
    report.latency_p99_ms[t.name] = float(np.percentile(ms, 99)) if len(ms) else nan
