"""RouteLLM's measures of a cost-quality curve (eval/anchors.py), against RouteLLM's own formulas."""

from __future__ import annotations

import numpy as np
import pytest

from eval import anchors


def routellm_apgr(shares: np.ndarray, accuracy: np.ndarray, weak: float, strong: float) -> float:
    """``routellm/evals/evaluate.py``'s apgr_metric (shares in [0, 1], sorted)."""
    area = np.trapezoid(accuracy, shares)
    weak_area = np.trapezoid(np.full(len(shares), weak), shares)
    strong_area = np.trapezoid(np.full(len(shares), strong), shares)
    return float((area - weak_area) / (strong_area - weak_area))


def test_the_diagonal_is_random_routing() -> None:
    xs = np.linspace(0, 1, 11)
    acc = 0.6 + 0.2 * xs
    assert anchors.apgr(xs, acc, 0.6, 0.8) == pytest.approx(0.5)
    assert anchors.cpt(xs, acc, 0.6, 0.8, 0.5) == pytest.approx(0.5)
    assert anchors.cpt(xs, acc, 0.6, 0.8, 0.8) == pytest.approx(0.8)


def test_apgr_and_cpt_are_routellms_on_a_ten_bin_curve() -> None:
    xs = np.linspace(0, 1, 11)  # RouteLLM's thresholds at the deciles of the score
    acc = np.array([0.60, 0.66, 0.70, 0.72, 0.74, 0.76, 0.77, 0.78, 0.79, 0.795, 0.80])
    assert anchors.apgr(xs, acc, 0.6, 0.8) == pytest.approx(routellm_apgr(xs, acc, 0.6, 0.8))
    for q in (0.2, 0.5, 0.8):  # pct_call_metric: np.interp of the level against the accuracies
        assert anchors.cpt(xs, acc, 0.6, 0.8, q) == pytest.approx(np.interp(0.6 + q * 0.2, acc, xs))


def test_a_dip_counts_as_it_is_no_envelope() -> None:
    xs = [0.0, 0.2, 0.4, 1.0]
    rising = anchors.apgr(xs, [0.6, 0.75, 0.75, 0.8], 0.6, 0.8)
    dipping = anchors.apgr(xs, [0.6, 0.75, 0.65, 0.8], 0.6, 0.8)
    assert rising is not None and dipping is not None and dipping < rising


def test_the_curve_is_closed_at_its_ends_and_no_gap_has_no_measure() -> None:
    # a router whose cheapest point already sends some to the strong model: (0, weak) is added
    x, y = anchors.closed([0.3, 0.7], [0.7, 0.78], 0.6, 0.8)
    assert list(x) == [0.0, 0.3, 0.7, 1.0] and list(y) == [0.6, 0.7, 0.78, 0.8]
    assert anchors.apgr([0.0, 1.0], [0.7, 0.7], 0.7, 0.7) is None
    assert anchors.cpt([0.0, 1.0], [0.7, 0.7], 0.7, 0.7, 0.5) is None


def test_cost_at_a_share_of_the_best_single_model() -> None:
    costs = [0.1, 0.3, 0.5, 1.2]  # money; the best single model costs 1.0 and is right on 0.8
    acc = [0.6, 0.74, 0.80, 0.82]
    m = anchors.measure(anchors.cost_axis(costs, 0.1, 1.0), acc, 0.6, 0.8, "cost", costs, (0.8, 1.0))
    # 95% of 0.8 is 0.76: between (0.3, 0.74) and (0.5, 0.80), a third of the way
    assert m.cost_for_95 == pytest.approx(0.3 + 0.2 * (0.02 / 0.06))
    assert m.share_for_100 == pytest.approx(0.5)
    assert "APGR" in m.line() and "95% of it at" in m.line()
    never = anchors.measure([0.0, 1.0], [0.5, 0.6], 0.5, 0.6, "strong share", best=(0.9, 1.0))
    assert never.cost_for_95 is None and never.share_for_100 is None


def test_reaching_takes_the_first_crossing() -> None:
    assert anchors.reaching([0.0, 0.5, 1.0], [0.5, 1.0, 1.0], 0.75) == pytest.approx(0.25)
    assert anchors.reaching([0.0, 0.5, 1.0], [0.5, 0.9, 0.95], 0.99) is None
    assert anchors.reaching([0.2, 0.5], [0.9, 0.95], 0.5) == pytest.approx(0.2)  # reached at the first point
