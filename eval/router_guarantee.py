"""The learned router's knob with a guarantee (issue 31, item 3): ``triage calibrate --router NAME
--target KIND=X --guarantee DELTA`` certifies the knob by Learn-then-Test (:mod:`eval.guarantee`), as
the cascade's threshold is, so that the target holds on new traffic like the calibration rows with
probability at least ``1 - DELTA``.

The candidates are a grid fixed before the rows are seen (a margin from 0 to 1; a utility's
``lam`` on a log scale from 1e-3 to 1e9 quality points per unit of money), walked from the safest:

- ``quality=X`` and ``of_strong=X`` (accuracy, or a share of the strongest candidate's accuracy, at
  least X): from knob 0 (the best predicted candidate) toward the cheapest; the last certified is
  the cheapest knob whose target holds;
- ``strong_share=X`` and ``cost=X`` (at most X): from the cheapest toward knob 0; the last certified
  is the most accurate within the budget.

The calibration rows' predictions are out of fold (each row predicted by heads that never saw it),
while the gateway serves the head fitted on every dev row: the bound is exact for the fold heads,
and an approximation for the whole head, which saw more rows (the test rows check it).
"""

from __future__ import annotations

import numpy as np

from eval.guarantee import DEFAULT_SEED, Certified, fixed_sequence, share_of_top_losses
from policies.routed import MAX_KNOB, Rule, Target, choose


def knobs(rule: Rule) -> list[float]:
    """The candidates, from knob 0 (the best predicted) to the cheapest; the same for any rows."""
    if rule == "margin":
        return [round(k / 400, 4) for k in range(401)]
    return [0.0, *np.logspace(-3, 9, 601).tolist(), MAX_KNOB]


def certify_knob(
    quality: np.ndarray,
    cost: np.ndarray,
    rule: Rule,
    target: Target,
    strongest: int,
    correct: np.ndarray,
    delta: float,
    grid: list[float] | None = None,
    seed: int = DEFAULT_SEED,
) -> Certified:
    """The knob certified to meet ``target`` on new rows like these (``quality``: predicted P(right),
    rows x candidates; ``cost``: candidates, or rows x candidates; ``correct``: 1, 0 or NaN for no
    answer, which counts as wrong). Refused (knob None) when not even the safest is certified."""
    q = np.atleast_2d(np.asarray(quality, dtype=np.float64))
    c = np.broadcast_to(np.asarray(cost, dtype=np.float64), q.shape)
    right = np.nan_to_num(np.asarray(correct, dtype=np.float64), nan=0.0)
    rows = np.arange(len(q))
    ordered = grid if grid is not None else knobs(rule)

    def picked(knob: float) -> np.ndarray:
        return choose(q, c, rule, knob)

    x = target.value
    if target.kind == "quality":
        return fixed_sequence(
            ordered, lambda k: (1.0 - right[rows, picked(k)]).tolist(), 1.0 - x, 0.0, 1.0, delta, seed
        )
    if target.kind == "of_strong":
        strong = right[:, strongest].astype(bool).tolist()

        def losses(k: float) -> list[float]:
            return share_of_top_losses(right[rows, picked(k)].astype(bool).tolist(), strong, x)

        return fixed_sequence(ordered, losses, 0.0, -1.0, x, delta, seed)
    cheapest_first = ordered[::-1]
    if target.kind == "strong_share":
        return fixed_sequence(
            cheapest_first, lambda k: (picked(k) == strongest).astype(float).tolist(), x, 0.0, 1.0, delta, seed
        )
    dearest = float(c.max()) if c.size and float(c.max()) > 0 else 1.0
    return fixed_sequence(cheapest_first, lambda k: c[rows, picked(k)].tolist(), x, 0.0, dearest, delta, seed)
