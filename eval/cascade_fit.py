"""Fitting the cascade on ``dev`` rows (:mod:`eval.cascade_eval` measures it): each tier's
temperature per question type, then for each tier but the last, per type, the lowest threshold at
which the questions it keeps are answered at least as well by it as by the last tier (less
``slack``), or to a target: an accuracy, an escalation share, a cost budget, a share of the top's
accuracy, or a target certified to hold with probability ``1 - delta`` (``fit_with_guarantee``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from classifiers.calibration import fit_temperature
from eval import guarantee
from eval.cascade_eval import GRID, TierSpec, evaluate, gate_confidence, row_outcomes, usable, voted
from eval.tier_outputs import Row
from policies.cascade import (
    read,
)


def fit_temperatures(tier: TierSpec, dev: Sequence[Row]) -> None:
    by_type: dict[str, list[Row]] = defaultdict(list)
    for r in usable(dev, tier.outputs):
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
    """Per type (and per task, for questions that name one), for each tier but the last, the lowest
    threshold such that:
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
            mine = voted(tiers, i, r, read(r.question, tier.gate(), a))
            theirs = voted(tiers, list(tiers).index(top), r, read(r.question, top.gate(), b))
            conf = gate_confidence(tiers, i, r, mine)
            group = f"task:{r.question.task}" if r.question.task is not None else r.question.type
            by_type[group].append((conf, mine.answer == r.answer, theirs.answer == r.answer))
        for group, points in by_type.items():
            fitted = _fitted_threshold(points, i, slack, target)
            if group.startswith("task:"):
                tier.task_thresholds[group.removeprefix("task:")] = fitted
            else:
                tier.thresholds[group] = fitted


def _fitted_threshold(
    points: list[tuple[float, bool, bool]], i: int, slack: float, target: tuple[str, float] | None
) -> float:
    if target is not None and target[0] == "accuracy":
        return _lowest_at_least(points, target[1])
    if target is not None and target[0] == "escalation" and i == 0:
        confidences = sorted(c for c, _, _ in points)
        k = min(int(target[1] * len(confidences)), len(confidences) - 1)
        return float(confidences[k])  # about a share x falls below it
    return _lowest_safe(points, slack)


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


def _set_all(tiers: Sequence[TierSpec], rows: Sequence[Row], t: float) -> None:
    tasks = {r.question.task for r in rows if r.question.task is not None}
    for tier in tiers[:-1]:
        tier.thresholds = {q: t for q in ("choice", "yes_no", "score")}
        tier.task_thresholds = dict.fromkeys(tasks, t)


def fit_for_share_of_top(tiers: Sequence[TierSpec], dev: Sequence[Row], share: float) -> None:
    """``--target of_top=X``: one threshold for every tier but the last (and every task), the one
    that sends the fewest questions past the first tier while the cascade keeps at least ``X`` of
    the accuracy of each set's last tier alone, pooled over the dev rows. Meant for learned gates,
    whose P(right) is one calibrated scale for every tier and type."""
    best: tuple[float, float, float] | None = None  # (past_first, -accuracy, threshold)
    for t in GRID:
        _set_all(tiers, dev, float(t))
        reports = evaluate(tiers, dev, curves=False)
        n = sum(r.n for r in reports) or 1
        accuracy = sum(r.cascade * r.n for r in reports) / n
        top = sum(r.alone[r.tiers[-1]] * r.n for r in reports if r.tiers) / n
        past = sum(r.past_first * r.n for r in reports) / n
        if accuracy >= share * top and (best is None or (past, -accuracy) < best[:2]):
            best = (past, -accuracy, float(t))
    _set_all(tiers, dev, best[2] if best is not None else 1.0)


def fit_with_guarantee(
    tiers: Sequence[TierSpec], dev: Sequence[Row], target: tuple[str, float], delta: float
) -> guarantee.Certified:
    """``--target KIND=X --guarantee DELTA``: one threshold for every tier but the last (and every
    task), certified by Learn-then-Test (:mod:`eval.guarantee`) so that the target holds on new
    traffic like ``dev`` with probability at least ``1 - DELTA``; the lowest certified for
    ``of_top`` (the fewest escalations), the highest for ``escalation`` and ``cost`` (the best
    accuracy within them). Refused (knob None: the thresholds are left at 1.0, everything to the
    top) when not even the safest threshold is certified."""
    kind, x = target

    def at(t: float) -> list[tuple[bool, bool, float, bool]]:
        _set_all(tiers, dev, t)
        return row_outcomes(tiers, dev)

    if kind == "of_top":
        knobs, lo, hi = sorted(GRID, reverse=True), -1.0, x  # 1.0: every question to the top

        def losses(t: float) -> list[float]:
            rows = at(t)
            return guarantee.share_of_top_losses([o[0] for o in rows], [o[3] for o in rows], x)

        cert = guarantee.fixed_sequence(knobs, losses, 0.0, lo, hi, delta)
    elif kind == "escalation":  # 0.0: the first tier keeps all it can
        cert = guarantee.fixed_sequence(sorted(GRID), lambda t: [float(o[1]) for o in at(t)], x, 0.0, 1.0, delta)
    elif kind == "cost":
        _set_all(tiers, dev, 1.0)
        dearest = max((o[2] for o in row_outcomes(tiers, dev)), default=0.0) or 1.0
        cert = guarantee.fixed_sequence(sorted(GRID), lambda t: [o[2] for o in at(t)], x, 0.0, dearest, delta)
    else:
        raise ValueError(f"--guarantee holds of_top, escalation or cost targets, not {kind}")
    _set_all(tiers, dev, cert.knob if cert.knob is not None else 1.0)
    return cert


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
