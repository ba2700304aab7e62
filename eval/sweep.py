"""The cost-quality curve of a cascade, with RouteLLM's measures. Pure: replays cached outputs.

One knob is swept: the same threshold ``s`` for every tier but the last, on each tier's own
confidence scale, from 0 (the first tier answers everything) to just above 1 (everything goes to
the last tier). Each ``s`` gives a point: the share of questions escalated past the first tier
(the cost axis) and the cascade's accuracy.

- PGR (performance gap recovered) at a point: ``(acc - acc_first) / (acc_last - acc_first)``,
  where ``acc_first`` is the cascade at ``s = 0`` (the first tier answers all it can) and
  ``acc_last`` at ``s > 1`` (the last tier answers everything).
- APGR: the area under PGR against the escalated share (trapezoids, the curve closed at share
  0 and 1). Random routing, which escalates a random share ``p`` of questions, recovers ``p`` of
  the gap on average: its APGR is 0.5.
- The escalated share needed for 50% and 80% of the gap (CPT(50%), CPT(80%)): the least on the
  curve, linear between its points, that reaches it; and the share needed for 95% and 100% of the
  best single tier's accuracy. All as RouteLLM defines them, in :mod:`eval.anchors`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from eval import anchors
from eval.tier_outputs import Row
from policies.cascade import Ask, CascadeExhausted, Gate, TierAnswer, drive, steps

STEPS = tuple(round(x, 3) for x in (*np.linspace(0.0, 1.0, 41), 1.001))


@dataclass
class Curve:
    points: list[tuple[float, float]] = field(default_factory=list)  # (share past the first tier, accuracy)
    first: float = float("nan")  # the first tier on everything
    last: float = float("nan")  # the last tier on everything
    apgr: float = float("nan")
    share_for_50: float | None = None
    share_for_80: float | None = None
    anchored: anchors.Anchors | None = None  # the same, with the share for 95% / 100% of the best tier


def curve(
    gates: Sequence[Gate],
    outputs: Sequence[Mapping[str, TierAnswer]],
    rows: Sequence[Row],
    right: Callable[[Row, str], bool],
    best: float | None = None,
) -> Curve:
    """The swept curve of ``gates`` (their thresholds replaced) over ``rows``; ``outputs[i]`` maps a
    row id to tier i's answer, ``right(row, answer)`` says whether an answer is right; ``best``: the
    best single tier's accuracy (default: the last tier's)."""
    if len(gates) < 2 or not rows:
        return Curve()
    out = Curve()
    for s in STEPS:
        swept = [
            replace(g, thresholds={t: s for t in ("choice", "yes_no", "score")}, task_thresholds={}) for g in gates[:-1]
        ] + [gates[-1]]
        wins, past = 0, 0
        for r in rows:

            def answer_for(ask: Ask, r: Row = r) -> TierAnswer:
                return outputs[_index(gates, ask.tier)][r.id]

            try:
                d = drive(steps(r.question, swept, embedding=r.embedding), answer_for)
            except CascadeExhausted:
                past += 1
                continue
            wins += right(r, d.answer)
            past += d.tier != gates[0].name
        out.points.append((past / len(rows), wins / len(rows)))
    out.first, out.last = out.points[0][1], out.points[-1][1]  # s = 0 and s above 1
    out.points.sort()
    _measures(out, best)
    return out


def _index(gates: Sequence[Gate], name: str) -> int:
    return next(i for i, g in enumerate(gates) if g.name == name)


def _measures(c: Curve, best: float | None = None) -> None:
    gap = c.last - c.first
    if not np.isfinite(gap) or abs(gap) < 1e-12:
        return
    xs, accs = [x for x, _ in c.points], [a for _, a in c.points]
    m = anchors.measure(
        xs, accs, c.first, c.last, "over the share escalated", best=(c.last if best is None else best, 1.0)
    )
    c.anchored = m
    c.apgr = float("nan") if m.apgr is None else m.apgr
    c.share_for_50, c.share_for_80 = m.cpt_50, m.cpt_80
