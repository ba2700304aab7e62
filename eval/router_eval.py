"""The learned router against its baselines on a labels file. Pure: labels, predictions and prices in.

On test rows (the heads never saw them), for the router's knob swept from the best predicted to
the cheapest:

- the accuracy-cost curve, beside every single model (a point each), random mixtures of each pair
  of models (a line each: cost and accuracy are linear in the mixing share), the category table
  (the best model per category on dev rows: what a hand-written vLLM Semantic Router policy
  routes by), and the oracle (the cheapest model that was right, per row);
- for two-model sets, RouteLLM's measures over the share of calls to the strong model: PGR at each
  share, APGR (the area under it; random routing 0.5), CPT(50%) and CPT(80%) (the strong share
  that recovers 50% / 80% of the gap) and the share for 95% of the strong model's accuracy;
- for every set, the same measures in the anchors' terms (:mod:`eval.anchors`, one definition):
  over the strong share (two models) or over the cost from the cheapest model's to the strongest's
  (more), with the cost at 95% and 100% of the best single model's accuracy.

A model's missing answer counts as wrong everywhere (MMLU-Pro's own scorer guesses instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from eval import anchors
from policies.routed import Rule, choose, knob_grid

AT_SHARES = (0.3, 0.4, 0.5)


@dataclass
class Point:
    accuracy: float
    cost: float  # mean per request
    strong_share: float


@dataclass
class RouterReport:
    name: str
    models: list[str]
    rows: int
    singles: dict[str, Point]
    router: list[Point]  # the swept curve, cheapest first
    category_table: Point
    category_choice: dict[str, str]
    oracle: Point
    strongest: str  # the most accurate single model on dev rows
    best_single_at_cost: dict[str, float] = field(default_factory=dict)  # router vs the best model
    two_model: dict[str, float | None] = field(default_factory=dict)  # RouteLLM's measures (two models only)
    anchored: anchors.Anchors | None = None  # the same for any number of models (:func:`anchor_measures`)


def _right(correct: np.ndarray) -> np.ndarray:
    return np.nan_to_num(np.asarray(correct, dtype=np.float64), nan=0.0)


def _point(right: np.ndarray, cost: np.ndarray, picked: np.ndarray, strongest: int) -> Point:
    rows = np.arange(len(picked))
    c = np.broadcast_to(cost, right.shape)
    return Point(float(right[rows, picked].mean()), float(c[rows, picked].mean()), float((picked == strongest).mean()))


def sweep(
    quality: np.ndarray, cost: np.ndarray, correct: np.ndarray, rule: Rule, strongest: int, extra: float = 0.0
) -> list[Point]:
    """The router's points, its knob swept; ``extra``: a mean cost per request the router pays
    whatever it chooses (its probe's readings)."""
    right = _right(correct)
    points = [
        _point(right, cost, choose(quality, cost, rule, float(k)), strongest) for k in knob_grid(quality, cost, rule)
    ]
    points = [Point(p.accuracy, p.cost + extra, p.strong_share) for p in points]
    points.sort(key=lambda p: (p.cost, -p.accuracy))
    return points


def category_table(
    dev_right: np.ndarray, dev_cats: Sequence[str], c: np.ndarray, models: Sequence[str]
) -> dict[str, str]:
    """Per category, the model most often right on dev rows (the cheaper of equals by mean cost ``c``)."""
    table: dict[str, str] = {}
    cats = np.asarray(dev_cats)
    overall = int(np.lexsort((c, -dev_right.mean(axis=0)))[0])
    table[""] = models[overall]
    for cat in sorted(set(dev_cats)):
        m = cats == cat
        best = int(np.lexsort((c, -dev_right[m].mean(axis=0)))[0])
        table[cat] = models[best]
    return table


def evaluate(
    name: str,
    models: Sequence[str],
    quality: np.ndarray,
    correct: np.ndarray,
    cost: np.ndarray,
    categories: Sequence[str],
    dev_correct: np.ndarray,
    dev_categories: Sequence[str],
    rule: Rule = "utility",
    router_extra_cost: float = 0.0,
) -> RouterReport:
    """``quality``/``correct``/``cost``: test rows (``cost`` (models,) or (rows, models));
    ``dev_*``: the dev rows, for the category table and for which model counts as the strongest;
    ``router_extra_cost``: what the router pays a request beyond the chosen model (its probe)."""
    right, dev_right = _right(correct), _right(dev_correct)
    mean_cost = np.broadcast_to(cost, right.shape).mean(axis=0)
    strongest = int(np.lexsort((mean_cost, -dev_right.mean(axis=0)))[0])
    singles = {
        m: Point(float(right[:, j].mean()), float(mean_cost[j]), float(j == strongest)) for j, m in enumerate(models)
    }
    table = category_table(dev_right, dev_categories, mean_cost, models)
    by_cat = np.array([models.index(table.get(c, table[""])) for c in categories])
    c_full = np.broadcast_to(cost, right.shape)
    oracle_pick = np.where(
        right.any(axis=1), np.argmin(np.where(right > 0, c_full, np.inf), axis=1), np.argmin(c_full, axis=1)
    )
    report = RouterReport(
        name,
        list(models),
        len(right),
        singles,
        sweep(quality, cost, correct, rule, strongest, router_extra_cost),
        _point(right, cost, by_cat, strongest),
        {k: v for k, v in table.items() if k},
        _point(right, cost, oracle_pick, strongest),
        models[strongest],
    )
    report.best_single_at_cost = versus_best_single(report)
    report.anchored = anchor_measures(report)
    if len(models) == 2:
        report.two_model = routellm_measures(
            report.router, singles[models[1 - strongest]].accuracy, singles[models[strongest]].accuracy
        )
    return report


def versus_best_single(report: RouterReport) -> dict[str, float]:
    """The router against the most accurate single model on test rows: its accuracy at (at most)
    that model's cost, and the least cost at which it matches that model's accuracy (linear between
    two settings of the knob: a mixture of the two, :func:`eval.anchors.reaching`)."""
    best = max(report.singles.values(), key=lambda p: (p.accuracy, -p.cost))
    within = [p.accuracy for p in report.router if p.cost <= best.cost + 1e-15]
    match = anchors.reaching([p.cost for p in report.router], [p.accuracy for p in report.router], best.accuracy)
    return {
        "best_accuracy": best.accuracy,
        "best_cost": best.cost,
        "router_accuracy_at_best_cost": max(within) if within else float("nan"),
        "router_cost_to_match": float("nan") if match is None else match,
        "cost_share_to_match": (match / best.cost) if match is not None and best.cost > 0 else float("nan"),
    }


def anchor_measures(report: RouterReport) -> anchors.Anchors:
    """The router's curve in the anchors' terms: over the strong share with two models (RouteLLM's
    axis), else over the cost from the cheapest model's to the strongest's; the cost at 95% and 100%
    of the best single model's accuracy in money, and as a share of that model's cost."""
    strong = report.singles[report.strongest]
    weak = min(report.singles.values(), key=lambda p: (p.cost, -p.accuracy))
    best = max(report.singles.values(), key=lambda p: (p.accuracy, -p.cost))
    costs, accs = [p.cost for p in report.router], [p.accuracy for p in report.router]
    if len(report.singles) == 2:
        xs, axis = [p.strong_share for p in report.router], "over the strong share"
    else:
        xs, axis = (
            list(anchors.cost_axis(costs, weak.cost, strong.cost)),
            "over the cost from the cheapest to the strongest",
        )
    return anchors.measure(xs, accs, weak.accuracy, strong.accuracy, axis, costs, (best.accuracy, best.cost))


def pgr_curve(points: Sequence[Point], weak: float, strong: float) -> tuple[np.ndarray, np.ndarray]:
    """(strong share, PGR) along the router's curve, closed at shares 0 and 1 (:func:`eval.anchors.closed`)."""
    xs, accs = anchors.closed([p.strong_share for p in points], [p.accuracy for p in points], weak, strong)
    gap = strong - weak
    return xs, (accs - weak) / gap if gap else np.ones_like(accs)


def routellm_measures(points: Sequence[Point], weak: float, strong: float) -> dict[str, float | None]:
    """RouteLLM's measures over the strong share (:mod:`eval.anchors`)."""
    shares, accs = [p.strong_share for p in points], [p.accuracy for p in points]
    xs, ys = pgr_curve(points, weak, strong)
    need = {f"cpt_{int(q * 100)}": anchors.cpt(shares, accs, weak, strong, q) for q in anchors.LEVELS}
    # the accuracy reached at (at most) a share of strong calls, as a share of the strong model's
    at = (
        {
            f"of_strong_at_{int(s * 100)}pct": float((weak + np.interp(s, xs, ys) * (strong - weak)) / strong)
            for s in AT_SHARES
        }
        if strong
        else {}
    )
    return {
        "apgr": anchors.apgr(shares, accs, weak, strong),
        **need,
        "share_for_95pct_of_strong": _first_share(
            xs, ys, (0.95 * strong - weak) / (strong - weak) if strong != weak else 0.0
        ),
        "share_for_98pct_of_strong": _first_share(
            xs, ys, (0.98 * strong - weak) / (strong - weak) if strong != weak else 0.0
        ),
        **at,
        "weak_accuracy": weak,
        "strong_accuracy": strong,
    }


def _first_share(xs: np.ndarray, ys: np.ndarray, level: float) -> float | None:
    return anchors.reaching(xs, ys, level)


def random_mixture(a: Point, b: Point, steps: int = 11) -> list[Point]:
    """Sending a random share of requests to ``b``, the rest to ``a``."""
    return [
        Point(
            a.accuracy + s * (b.accuracy - a.accuracy),
            a.cost + s * (b.cost - a.cost),
            a.strong_share + s * (b.strong_share - a.strong_share),
        )
        for s in np.linspace(0, 1, steps)
    ]
