"""RouteLLM's measures of a cost-quality curve, one definition for every curve the eval prints: the
router's (``triage eval --router``), the cascade's (``triage eval``) and the benchmarks'. Pure.

The definitions are RouteLLM's (arXiv 2406.18665, section 5; ``routellm/evals/evaluate.py``):

- A curve is a set of points ``(x, accuracy)``, ``x`` on [0, 1] the cost axis: the share of calls to
  the strong model (RouteLLM), the share escalated past the first tier (a cascade), or, with many
  models, the mean cost as a share of the way from the weak end (the cheapest model) to the strong
  end (the best single model): ``(cost - c_weak) / (c_strong - c_weak)``.
- ``PGR(x) = (accuracy(x) - weak) / (strong - weak)``.
- **APGR** (``apgr_metric``): the trapezoid area under the accuracy curve over the ``x`` it spans,
  less the weak model's area over the same span, over the strong model's less the weak's: the mean
  PGR over the span. RouteLLM's thresholds at the score's extremes give the points ``(0, weak)`` and
  ``(1, strong)``; a curve that does not reach them is closed with them here. No envelope: a point
  under an earlier one counts as it is (an earlier version of the router's report took the best
  PGR reached at or under each share, which reads higher). Points beyond ``x = 1`` (dearer than the
  strong model) are outside the span.
- **CPT(q)** (``pct_call_metric``): the ``x`` at which the curve, linear between its points, first
  reaches PGR ``q``; RouteLLM interpolates the level against the accuracies (``np.interp``), the same
  on a rising curve. A point between two settings is a mixture of the two, so it is reachable.
- **The cost at a share of the best single model's accuracy** (95% and 100%): the same first
  reaching, on the curve's own cost axis (money, or the share of calls), and as a share of the best
  model's cost; None where the curve never reaches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Floats = Sequence[float] | np.ndarray
LEVELS = (0.5, 0.8)  # CPT(50%), CPT(80%)
OF_BEST = (0.95, 1.0)  # the cost at 95% and 100% of the best single model's accuracy


def _sorted(xs: Floats, ys: Floats) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    order = np.lexsort((y[keep], x[keep]))  # equal x: the lower first (a vertical step adds no area)
    return x[keep][order], y[keep][order]


def closed(xs: Floats, accuracy: Floats, weak: float, strong: float) -> tuple[np.ndarray, np.ndarray]:
    """The curve on [0, 1], sorted by ``x``, with ``(0, weak)`` and ``(1, strong)`` where it lacks them."""
    x, y = _sorted(xs, accuracy)
    inside = (x >= 0.0) & (x <= 1.0)
    x, y = x[inside], y[inside]
    if not x.size or x[0] > 0.0:
        x, y = np.r_[0.0, x], np.r_[weak, y]
    if x[-1] < 1.0:
        x, y = np.r_[x, 1.0], np.r_[y, strong]
    return x, y


def apgr(xs: Floats, accuracy: Floats, weak: float, strong: float) -> float | None:
    """RouteLLM's APGR of the curve (None where the strong model is no better than the weak)."""
    if not strong - weak > 1e-12:
        return None
    x, y = closed(xs, accuracy, weak, strong)
    span = x[-1] - x[0]
    area = float(np.trapezoid(y, x))
    return (area - weak * span) / ((strong - weak) * span)


def reaching(xs: Floats, ys: Floats, level: float) -> float | None:
    """The least ``x`` at which the curve, linear between its points (sorted by ``x``), reaches
    ``level``; None where it never does."""
    x, y = _sorted(xs, ys)
    hit = np.flatnonzero(y >= level - 1e-12)
    if not hit.size:
        return None
    i = int(hit[0])
    if i == 0 or y[i] == y[i - 1]:
        return float(x[i])
    return float(x[i - 1] + (level - y[i - 1]) * (x[i] - x[i - 1]) / (y[i] - y[i - 1]))


def cpt(xs: Floats, accuracy: Floats, weak: float, strong: float, q: float) -> float | None:
    """RouteLLM's CPT(q): the least ``x`` whose PGR reaches ``q`` (None: never, or no gap)."""
    if not strong - weak > 1e-12:
        return None
    x, y = closed(xs, accuracy, weak, strong)
    return reaching(x, y, weak + q * (strong - weak))


@dataclass(frozen=True)
class Anchors:
    """A curve's measures in the anchors' terms. ``axis``: what ``x`` is ("strong share", "escalated
    share" or "cost share": of the way from the weak end's cost to the strong end's)."""

    axis: str
    weak: float  # accuracy at x = 0
    strong: float  # at x = 1
    apgr: float | None
    cpt_50: float | None
    cpt_80: float | None
    best: float  # the best single model's (tier's) accuracy
    best_cost: float  # ... and its cost, on the curve's cost axis
    cost_for_95: float | None  # the least cost reaching 95% of ``best`` (same unit as best_cost)
    cost_for_100: float | None
    share_for_95: float | None  # ... as a share of ``best_cost``
    share_for_100: float | None

    def line(self) -> str:
        """One line for the console."""

        def f(v: float | None, fmt: str = ".3f") -> str:
            return "-" if v is None else format(v, fmt)

        return (
            f"RouteLLM measures ({self.axis}): APGR {f(self.apgr)}, CPT(50%) {f(self.cpt_50)}, "
            f"CPT(80%) {f(self.cpt_80)}; the best single {self.best:.4f}: 95% of it at "
            f"{f(self.share_for_95, '.1%')} of its cost, 100% at {f(self.share_for_100, '.1%')}"
        )


def measure(
    xs: Floats,
    accuracy: Floats,
    weak: float,
    strong: float,
    axis: str,
    costs: Floats | None = None,
    best: tuple[float, float] | None = None,
) -> Anchors:
    """The curve ``(xs, accuracy)`` measured against ``weak`` and ``strong`` (its ends); ``costs``:
    each point's cost (default: ``xs``) and ``best``: the best single model's (accuracy, cost) on that
    axis (default: ``(strong, 1.0)``), for the cost at 95% and 100% of its accuracy."""
    x, y = closed(xs, accuracy, weak, strong)
    c = list(xs if costs is None else costs)
    b_acc, b_cost = best if best is not None else (strong, 1.0)
    at = {q: reaching(c, accuracy, q * b_acc) for q in OF_BEST}
    if costs is None:  # the closing points are on this axis too
        at = {q: reaching(x, y, q * b_acc) for q in OF_BEST}

    def share(v: float | None) -> float | None:
        return None if v is None or b_cost <= 0 else v / b_cost

    return Anchors(
        axis,
        weak,
        strong,
        apgr(xs, accuracy, weak, strong),
        cpt(x, y, weak, strong, LEVELS[0]),
        cpt(x, y, weak, strong, LEVELS[1]),
        b_acc,
        b_cost,
        at[OF_BEST[0]],
        at[OF_BEST[1]],
        share(at[OF_BEST[0]]),
        share(at[OF_BEST[1]]),
    )


def cost_axis(costs: Floats, c_weak: float, c_strong: float) -> np.ndarray:
    """Mean costs as the share of the way from the weak end's cost to the strong end's."""
    span = c_strong - c_weak
    c = np.asarray(costs, dtype=np.float64)
    return (c - c_weak) / span if span > 0 else np.zeros_like(c)
