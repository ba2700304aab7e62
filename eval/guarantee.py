"""Thresholds with a guarantee (issue 31): Learn-then-Test over one knob.

``triage calibrate --guarantee DELTA`` chooses the cascade's shared threshold so that its target
(the share of always-top accuracy kept, the share escalated past the first tier, or the mean cost
per question) holds on new traffic from the calibration rows' distribution with probability at
least ``1 - DELTA``. Learn-then-Test (Angelopoulos, Bates, Candès, Jordan, Lei, 2021) turns the
choice into multiple testing: for each candidate threshold the null hypothesis is "the target
fails here"; a candidate is certified when its null is rejected at level ``DELTA``.

- **The p-value** of one candidate is the Waudby-Smith--Ramdas betting test (2024) of a mean of
  losses bounded in ``[lo, hi]``: a nonnegative supermartingale under the null, so ``1 / max`` of it
  is a valid p-value by Ville's inequality. Its bets adapt to the losses' variance, so where the
  cascade mostly agrees with the top (the loss is nearly constant) it needs far fewer rows than
  Hoeffding's bound.
- **The family-wise error** is held by fixed-sequence testing: candidates are tested from the safest
  (the knob where the target holds by construction, or nearly) toward the cheapest, and the walk
  stops at the first that is not certified; every candidate before it is certified together at
  level ``DELTA`` with no correction. The chosen one is the last certified.
- **Refusal.** Where not even the safest candidate is certified, the rows are too few (or the
  target is not met even there): no threshold is returned, and the report says so.

Pure: numbers in, numbers out; the rows' order is shuffled with a fixed seed (the test needs the
losses in an order that does not depend on their values).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_SEED = 0


def betting_p_value(losses: Sequence[float], limit: float, lo: float, hi: float, seed: int = DEFAULT_SEED) -> float:
    """A p-value for the null "the losses' mean is at least ``limit``" (the target fails), against
    "it is below", for i.i.d. losses within ``[lo, hi]``: the hedged betting test of Waudby-Smith and
    Ramdas with predictable bets, one-sided. Small where the mean is clearly below the limit."""
    n = len(losses)
    if n == 0 or hi <= lo:
        return 1.0
    if limit >= hi:
        return 0.0  # no mean can reach it
    if limit <= lo:
        return 1.0  # every mean does
    z = (np.asarray(losses, dtype=float) - lo) / (hi - lo)
    z = np.clip(z, 0.0, 1.0)[np.random.default_rng(seed).permutation(n)]
    m = (limit - lo) / (hi - lo)  # the null's mean, on [0, 1]
    cap = 0.5 / (1.0 - m)  # the bets keep 1 + b (m - z) >= 1/2 for every z in [0, 1]
    alpha = 0.05  # the scale of the bets (WSR's default for the bets' truncation)
    i = np.arange(1, n + 1, dtype=float)
    before = np.concatenate(([0.0], np.cumsum(z)[:-1]))  # each bet sees only the losses before it
    mean_hat = (0.5 + before) / i
    squares = np.concatenate(([0.0], np.cumsum((z - mean_hat) ** 2)[:-1]))
    var_hat = (0.25 + squares) / i
    bets = np.minimum(np.sqrt(2.0 * math.log(2.0 / alpha) / (n * var_hat)), cap)
    log_wealth = np.cumsum(np.log1p(bets * (m - z)))
    return float(min(1.0, math.exp(-max(0.0, float(log_wealth.max())))))


@dataclass(frozen=True)
class Certified:
    """What fixed-sequence testing certified: the chosen knob (None: refused) and how it got there."""

    knob: float | None
    delta: float
    rows: int
    tested: int  # candidates tested, the last one not certified included
    p_values: tuple[tuple[float, float], ...]  # (knob, p-value) in the order tested
    observed: float | None  # the calibration rows' mean loss at the chosen knob

    @property
    def refused(self) -> bool:
        return self.knob is None


def fixed_sequence(
    knobs: Sequence[float],
    losses_at: Callable[[float], Sequence[float]],
    limit: float,
    lo: float,
    hi: float,
    delta: float,
    seed: int = DEFAULT_SEED,
) -> Certified:
    """Walk ``knobs`` from the first (the safest) and keep each whose null ("the mean loss is at least
    ``limit``") is rejected at ``delta``; stop at the first that is not. ``losses_at(knob)``: one loss
    per calibration row at that knob, within ``[lo, hi]``."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be within (0, 1), not {delta}")
    chosen: float | None = None
    observed: float | None = None
    tested: list[tuple[float, float]] = []
    rows = 0
    for knob in knobs:
        losses = losses_at(knob)
        rows = len(losses)
        p = betting_p_value(losses, limit, lo, hi, seed)
        tested.append((float(knob), p))
        if p > delta:
            break
        chosen, observed = float(knob), float(np.mean(losses)) if len(losses) else None
    return Certified(chosen, delta, rows, len(tested), tuple(tested), observed)


def share_of_top_losses(ok: Sequence[bool], top_ok: Sequence[bool], share: float) -> list[float]:
    """Per row, ``share * [the top alone is right] - [the cascade is right]``: their mean is at most 0
    exactly when the cascade keeps at least ``share`` of always-top accuracy. Within ``[-1, share]``."""
    return [share * float(t) - float(c) for c, t in zip(ok, top_ok, strict=True)]
