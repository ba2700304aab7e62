"""The cascade on labeled typed rows: each tier alone, the cascade at fitted thresholds, and the
share of questions each tier answered. Tier outputs come from :mod:`eval.tier_outputs` (computed
once, cached); the cascade itself is ``policies.cascade.steps``, the same generator the gateway drives.

Fitting, on ``dev`` rows only: each tier's temperature per question type (negative log-likelihood),
then each tier's confidence model (P(its answer is right), :mod:`classifiers.confidence`), then for
each tier but the last, per type, the lowest threshold at which the questions it would keep are
answered at least as well by it as by the last tier (less ``slack``). A tier with ``gate: learned``
is gated by its confidence model (thresholds fitted on its out-of-fold predictions); every tier's
model is fitted anyway, so the report compares the two signals' AUROC side by side.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from classifiers.calibration import auroc, ece
from classifiers.confidence import ConfidenceModel
from classifiers.training.confidence_training import fit_confidence
from eval.sweep import Curve, curve
from eval.tier_outputs import Row
from policies.answers import same_number
from policies.cascade import (
    Ask,
    CascadeExhausted,
    Gate,
    Reading,
    TierAnswer,
    after,
    agreed,
    drive,
    gated,
    keeps,
    read,
    signals,
    steps,
    task_head,
)
from policies.pool import Agreement

Outputs = Mapping[str, TierAnswer]  # row id -> the tier's answer
GRID = tuple(round(x, 3) for x in np.linspace(0.0, 1.0, 101))


@dataclass
class TierSpec:
    name: str
    kind: str
    outputs: Outputs
    temperatures: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    task_thresholds: dict[str, float] = field(default_factory=dict)  # for questions that name a task
    per_call: float = 0.0
    per_1k_tokens: float = 0.0
    gate_kind: str = "confidence"  # "learned": the thresholds are compared with the judge's P(right)
    escalation_margin: float | None = None  # learned: keep only within this of P(escalating gets it right)
    accuracy: dict[str, float] = field(default_factory=dict)  # per type: its answer's weight as a vote
    agreement: dict[str, Agreement] = field(default_factory=dict)  # per type: its confidence is the votes'
    orders: int = 1  # a lettered scorer's: its answers are the mean of this many orders of the options
    judge: ConfidenceModel | None = None  # fitted on dev rows (for the report, whatever the gate)
    judge_dev: dict[str, float] = field(default_factory=dict)  # its out-of-fold P(right) per dev row
    judge_fit: dict[str, Any] = field(default_factory=dict)  # what the fit chose and measured on dev rows

    def cost(self, answer: TierAnswer) -> float:
        tokens = sum(v for k, v in (answer.usage or {}).items() if k in ("prompt_tokens", "completion_tokens"))
        return self.per_call + self.per_1k_tokens * tokens / 1000

    def gate(self) -> Gate:
        judge = self.judge if self.gate_kind == "learned" else None
        return Gate(
            self.name,
            self.kind,
            dict(self.thresholds),
            dict(self.task_thresholds),
            dict(self.temperatures),
            judge,
            escalation_margin=self.escalation_margin,
            accuracy=dict(self.accuracy),
            agreement=dict(self.agreement),
            per_call=self.per_call,
            per_1k_tokens=self.per_1k_tokens,
        )

    def reading(self, row: Row) -> Reading | None:
        a = self.outputs.get(row.id)
        if a is None or a.skipped or a.error is not None or (a.scores is None and a.text is None):
            return None
        return read(row.question, self.gate(), a)


def previous(tiers: Sequence[TierSpec], i: int, row: Row) -> Reading | None:
    """The reading of the last tier before ``tiers[i]`` that answered ``row`` (what a learned gate
    compares with: the tiers before it all escalated, or ``tiers[i]`` would not be asked)."""
    for t in reversed(tiers[:i]):
        if (rd := t.reading(row)) is not None:
            return rd
    return None


def voted(tiers: Sequence[TierSpec], i: int, row: Row, reading: Reading) -> Reading:
    """Tier i's reading of ``row`` as the cascade keeps it: with agreement for the question's type,
    the votes of every tier up to it that answered (the tiers before it escalated, or it would not be
    asked), ``reading`` being its own; else ``reading``."""
    gate = tiers[i].gate()
    if not gate.agreement:
        return reading
    answered = [
        (t.gate(), rd, bool(t.outputs[row.id].assumed)) for t in tiers[:i] if (rd := t.reading(row)) is not None
    ]
    v = agreed(row.question, gate, [*answered, (gate, reading, bool(tiers[i].outputs[row.id].assumed))])
    return reading if v is None else v.reading


def _judgeable(tier: TierSpec, row: Row) -> bool:
    return not row.question.numeric and not task_head(tier.gate(), row.question)


def judge_p(tiers: Sequence[TierSpec], i: int, row: Row, reading: Reading) -> float | None:
    """Tier i's fitted P(right) for its reading of ``row``: out-of-fold on dev rows, else the model's."""
    t = tiers[i]
    if t.judge is None or not _judgeable(t, row):
        return None
    if row.id in t.judge_dev:
        return t.judge_dev[row.id]
    if t.judge.needs_embedding and row.embedding is None:
        return None
    return t.judge.p_right(signals(row.question, reading, previous(tiers, i, row), row.embedding))


def gate_confidence(tiers: Sequence[TierSpec], i: int, row: Row, reading: Reading) -> float:
    """What tier i's gate compares with its threshold for ``row``; -1 (kept at no threshold) where
    its escalation margin says escalating would do better."""
    gate, before = tiers[i].gate(), previous(tiers, i, row)
    if gate.agreement.get(row.question.type) is not None and not row.question.numeric:
        return voted(tiers, i, row, reading).confidence
    if tiers[i].gate_kind == "learned" and (p := judge_p(tiers, i, row, reading)) is not None:
        conf = p
    else:
        conf = gated(row.question, gate, reading, before, row.embedding)
    p_after = after(row.question, gate, reading, before, row.embedding)
    return conf if keeps(conf, 0.0, p_after, gate.escalation_margin) else -1.0


def fit_judges(tiers: Sequence[TierSpec], dev: Sequence[Row], upto: int | None = None) -> None:
    """Each tier's confidence model (the first ``upto`` tiers, by default every one but the last;
    never a recorded one) on dev rows, after its temperatures: P(its answer is right) from its
    probabilities, the question and the tier before it. A tier with too few rows, or none wrong,
    keeps none (``judge_fit['error']``)."""
    for i, t in enumerate(tiers[: len(tiers) - 1 if upto is None else upto]):
        if t.kind == "recorded":
            continue
        rows, sigs, ok, above = [], [], [], []
        for r in dev:
            if not _judgeable(t, r) or (rd := t.reading(r)) is None:
                continue
            rows.append(r)
            sigs.append(signals(r.question, rd, previous(tiers, i, r), r.embedding))
            ok.append(right(r, rd.answer))
            last = next((rl for u in reversed(tiers[i + 1 :]) if (rl := u.reading(r)) is not None), None)
            above.append(last is not None and right(r, last.answer))
        try:
            fitted = fit_confidence(t.name, sigs, ok, after=above)
        except ValueError as exc:
            t.judge, t.judge_dev, t.judge_fit = None, {}, {"error": str(exc)}
            continue
        t.judge, t.judge_dev = fitted.model, {r.id: float(p) for r, p in zip(rows, fitted.out_of_fold, strict=True)}
        fitted.model.meta["temperature"] = dict(t.temperatures)  # the features were read at these
        fitted.model.meta["orders"] = t.orders  # ... of answers read in this many orders
        t.judge_fit = {
            **fitted.model.meta,
            "dev_auroc_raw": round(fitted.auroc_raw, 4),
            "dev_auroc": round(fitted.auroc, 4),
            "tried": [list(x) for x in fitted.tried],
        }


def right(row: Row, answer: str) -> bool:
    """Numbers are compared as numbers (``policies.answers.same_number``), options as text."""
    return same_number(answer, row.answer) if row.question.numeric else answer == row.answer


def usable(rows: Sequence[Row], outputs: Outputs) -> list[Row]:
    return [r for r in rows if (a := outputs.get(r.id)) is not None and (a.scores is not None or a.text is not None)]


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
    auroc_raw: dict[str, float] = field(default_factory=dict)  # tier -> right/wrong AUROC of its own confidence
    auroc_learned: dict[str, float] = field(default_factory=dict)  # ... of its confidence model's P(right)
    ece_learned: dict[str, float] = field(default_factory=dict)  # ECE of that P(right)
    task: bool = False  # the rows are a task's intent questions (mixed traffic), not a typed set


def evaluate(tiers: Sequence[TierSpec], rows: Sequence[Row], curves: bool = True) -> list[SetReport]:
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.source, r.question.type)].append(r)
    return [_one_set(tiers, src, qtype, group, curves) for (src, qtype), group in sorted(groups.items())]


def _one_set(tiers: Sequence[TierSpec], source: str, qtype: str, rows: Sequence[Row], curves: bool = True) -> SetReport:
    tiers = [t for t in tiers if any(r.id in t.outputs for r in rows)]  # a recorded tier covers some sets only
    rows = [r for r in rows if all(r.id in t.outputs for t in tiers)]
    report = SetReport(source, qtype, len(rows), {}, {}, {})
    report.task = any(r.question.task is not None for r in rows)
    for i, t in enumerate(tiers):
        _measure_tier(report, t, rows)
        _measure_gate(report, tiers, i, rows)
    gates = [t.gate() for t in tiers]
    wins, failed, cost = 0, 0, 0.0
    answered_by: defaultdict[str, int] = defaultdict(int)
    categories: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
    for r, (ok, past, paid, tier) in zip(rows, _drive(tiers, rows), strict=True):
        wins += ok
        if tier is None:  # exhausted: counted as a miss, never as a guess
            failed += 1
        else:
            answered_by[tier] += 1
        cost += paid
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
        best = max((a for a in report.alone.values() if math.isfinite(a)), default=None)
        report.curve = curve(gates, [t.outputs for t in tiers], rows, right, best)
    return report


def _drive(tiers: Sequence[TierSpec], rows: Sequence[Row]) -> list[tuple[bool, bool, float, str | None]]:
    """Each row through the cascade at the tiers' present thresholds: (right, past the first tier,
    what the tiers asked cost, the tier that answered or None when none accepted)."""
    gates = [t.gate() for t in tiers]
    by_name = {t.name: t for t in tiers}
    out: list[tuple[bool, bool, float, str | None]] = []
    for r in rows:
        asked: list[str] = []

        def answer_for(ask: Ask, r: Row = r, asked: list[str] = asked) -> TierAnswer:
            asked.append(ask.tier)
            return by_name[ask.tier].outputs[r.id]

        try:
            d = drive(steps(r.question, gates, embedding=r.embedding), answer_for)
            ok, past, tier = right(r, d.answer), d.tier != tiers[0].name, d.tier
        except CascadeExhausted:
            ok, past, tier = False, True, None
        out.append((ok, past, sum(by_name[t].cost(by_name[t].outputs[r.id]) for t in asked), tier))
    return out


def row_outcomes(tiers: Sequence[TierSpec], rows: Sequence[Row]) -> list[tuple[bool, bool, float, bool]]:
    """Per row, set by set as :func:`evaluate` groups them (a recorded tier covers some sets only):
    (the cascade is right, it went past the first tier, its cost, the last tier alone is right)."""
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.source, r.question.type)].append(r)
    out: list[tuple[bool, bool, float, bool]] = []
    for _, group in sorted(groups.items()):
        present = [t for t in tiers if any(r.id in t.outputs for r in group)]
        usable = [r for r in group if all(r.id in t.outputs for t in present)]
        if not present or not usable:
            continue
        top = present[-1]
        for r, (ok, past, paid, _) in zip(usable, _drive(present, usable), strict=True):
            top_ok = right(r, read(r.question, top.gate(), top.outputs[r.id]).answer)
            out.append((ok, past, paid, top_ok))
    return out


def _brier(readings: Sequence[Any], rows: Sequence[Row]) -> float:
    scores = [
        sum((p - (o == r.answer)) ** 2 for o, p in rd.probabilities.items())
        for rd, r in zip(readings, rows, strict=True)
        if not r.question.numeric
    ]
    return float(np.mean(scores)) if scores else math.nan


def _measure_tier(report: SetReport, t: TierSpec, rows: Sequence[Row]) -> None:
    """One tier answering every row itself: accuracy, calibration before and after, latency."""
    kept = usable(rows, t.outputs)
    raw_gate = Gate(t.name, t.kind)
    after = [read(r.question, t.gate(), t.outputs[r.id]) for r in kept]
    before = [read(r.question, raw_gate, t.outputs[r.id]) for r in kept]
    correct = np.array([right(r, rd.answer) for rd, r in zip(after, kept, strict=True)], dtype=float)
    nan = math.nan
    report.alone[t.name] = float(correct.mean()) if len(correct) else nan
    report.ece[t.name] = ece(np.array([max(rd.probabilities.values()) for rd in after]), correct) if kept else nan
    report.ece_raw[t.name] = (
        ece(
            np.array([max(rd.probabilities.values()) for rd in before]),
            np.array([right(r, rd.answer) for rd, r in zip(before, kept, strict=True)], dtype=float),
        )
        if kept
        else nan
    )
    report.brier[t.name] = _brier(after, kept)
    report.brier_raw[t.name] = _brier(before, kept)
    ms = np.array([t.outputs[r.id].latency_ms for r in rows])
    report.latency_ms[t.name] = float(ms.mean()) if len(ms) else nan
    report.latency_p50_ms[t.name] = float(np.percentile(ms, 50)) if len(ms) else nan
    report.latency_p99_ms[t.name] = float(np.percentile(ms, 99)) if len(ms) else nan


def _gate_points(tiers: Sequence[TierSpec], i: int, rows: Sequence[Row]) -> list[tuple[str, float, float | None, bool]]:
    """Per row tier i answered: (type, its own confidence, its judge's P(right) or None, right)."""
    out: list[tuple[str, float, float | None, bool]] = []
    for r in rows:
        if not _judgeable(tiers[i], r) or (rd := tiers[i].reading(r)) is None:
            continue
        out.append((r.question.type, rd.confidence, judge_p(tiers, i, r, rd), right(r, rd.answer)))
    return out


def _signal_quality(points: Sequence[tuple[str, float, float | None, bool]]) -> dict[str, float]:
    y = np.array([ok for *_, ok in points], dtype=float)
    raw = np.array([c for _, c, _, _ in points])
    out = {"n": float(len(points)), "accuracy": float(y.mean()) if len(y) else math.nan}
    out["auroc_raw"] = auroc(raw, y) if len(y) and 0 < y.sum() < len(y) else math.nan
    learned = [p for _, _, p, _ in points]
    if points and all(p is not None for p in learned):
        p = np.array(learned, dtype=float)
        out["auroc_learned"] = auroc(p, y) if 0 < y.sum() < len(y) else math.nan
        out["ece_learned"] = ece(p, y)
    return out


def _measure_gate(report: SetReport, tiers: Sequence[TierSpec], i: int, rows: Sequence[Row]) -> None:
    q = _signal_quality(_gate_points(tiers, i, rows))
    name = tiers[i].name
    report.auroc_raw[name] = q["auroc_raw"]
    if "auroc_learned" in q:
        report.auroc_learned[name], report.ece_learned[name] = q["auroc_learned"], q["ece_learned"]


def gate_table(tiers: Sequence[TierSpec], rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Pooled over every set: per tier (not the last) and question type, how well its own
    confidence and its confidence model's P(right) tell its right answers from its wrong ones
    (AUROC), and the calibration of that P(right) (ECE); ``type`` "all" pools the types."""
    out = []
    for i, t in enumerate(tiers[:-1]):
        points = _gate_points(tiers, i, rows)
        for qtype in ("all", *sorted({p[0] for p in points})):
            part = [p for p in points if qtype in ("all", p[0])]
            if part:
                out.append({"tier": t.name, "type": qtype, **_signal_quality(part)})
    return out


def pooled(reports: Sequence[SetReport]) -> dict[str, float]:
    """Every set together: the cascade against each set's last tier alone ("always-top"), and the
    share of questions that reached that last tier."""
    n = sum(r.n for r in reports)
    if not n:
        return {}
    top = sum(r.n * r.alone.get(r.tiers[-1], math.nan) for r in reports if r.tiers) / n
    cascade = sum(r.n * r.cascade for r in reports) / n
    reached = sum(r.n * (r.share.get(r.tiers[-1], 0.0) + r.failed / max(r.n, 1)) for r in reports if r.tiers) / n
    best_gap = min((r.cascade - max(r.alone.values()) for r in reports if r.alone), default=math.nan)
    return {
        "n": float(n),
        "cascade": cascade,
        "always_top": top,
        "of_top": cascade / top if top else math.nan,
        "reached_top": reached,
        "worst_vs_best_tier": best_gap,
    }
