"""Thresholds with a guarantee (issue 31, item 3): Learn-then-Test over the cascade's knob, on
synthetic traffic whose truth is known. Over 200 resamplings of the calibration rows, the target
holds on the population at the chosen threshold in at least 1 - delta of them; the plain fit on the
same rows (the lowest threshold whose observed share meets the target) misses far more often; too
few rows are refused."""

from __future__ import annotations

import numpy as np
import pytest

from eval.guarantee import betting_p_value, fixed_sequence, share_of_top_losses

TOP = 0.85  # the top tier is right on 85% of questions, whatever the first tier's confidence
SHARE = 0.97
KNOBS = [round(1.0 - k / 100, 2) for k in range(101)]  # the safest first: 1.0 sends everything to the top


def true_share(t: float) -> float:
    """The population's share of always-top accuracy at threshold t: the first tier keeps the
    questions with confidence c >= t (c uniform on [0, 1], right with probability c), the top
    answers the rest."""
    return ((1 - t * t) / 2 + TOP * t) / TOP


def sample(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    c = rng.uniform(size=n)
    return c, rng.uniform(size=n) < c, rng.uniform(size=n) < TOP


def losses(c: np.ndarray, small: np.ndarray, top: np.ndarray, t: float) -> list[float]:
    cascade = np.where(c >= t, small, top)
    return share_of_top_losses(cascade.tolist(), top.tolist(), SHARE)


@pytest.mark.parametrize("delta", [0.1, 0.2])
def test_the_target_holds_in_at_least_one_minus_delta_of_resamplings(delta: float) -> None:
    rng = np.random.default_rng(31)
    held, naive_held, chosen = 0, 0, []
    for k in range(200):
        c, small, top = sample(rng, 1500)
        at = lambda t, c=c, small=small, top=top: losses(c, small, top, t)  # noqa: E731
        cert = fixed_sequence(KNOBS, at, 0.0, -1.0, SHARE, delta, seed=k)
        assert cert.knob is not None, "1,500 rows are enough here"
        chosen.append(cert.knob)
        held += true_share(cert.knob) >= SHARE
        naive = min(t for t in KNOBS if np.mean(losses(c, small, top, t)) <= 0)  # the plain fit: no bound
        naive_held += true_share(naive) >= SHARE
    assert held / 200 >= 1 - delta, (held, delta)
    assert naive_held / 200 < held / 200  # the bound is what holds it, not luck
    assert np.mean(chosen) < 0.9  # and it is not the trivial answer (everything to the top)


def test_too_few_rows_are_refused() -> None:
    rng = np.random.default_rng(7)
    c, small, top = sample(rng, 20)
    cert = fixed_sequence(KNOBS, lambda t: losses(c, small, top, t), 0.0, -1.0, SHARE, 0.1)
    assert cert.refused and cert.tested == 1 and cert.rows == 20


def test_the_p_value_is_valid_at_the_null_and_small_far_from_it() -> None:
    rng = np.random.default_rng(3)
    # at the null's edge (mean exactly the limit) the p-value is below delta at most delta of the time
    rejections = sum(betting_p_value(rng.uniform(size=400).tolist(), 0.5, 0.0, 1.0, seed=i) <= 0.1 for i in range(300))
    assert rejections / 300 <= 0.1 + 0.035  # 0.1 plus about two standard errors of 300 draws
    assert betting_p_value([0.1] * 200, 0.5, 0.0, 1.0) < 1e-6  # far below the limit, constant: certain
    assert betting_p_value([0.9] * 200, 0.5, 0.0, 1.0) == 1.0  # above it: never
    with pytest.raises(ValueError):
        fixed_sequence([1.0], lambda t: [0.0], 0.5, 0.0, 1.0, 1.5)


def test_calibrate_certifies_the_cascade_threshold_on_replayed_rows() -> None:
    """``triage calibrate --guarantee``'s fit on tier outputs: the cheap tier is right when sure (yes
    rows, confidence 0.9) and wrong when unsure (no rows, 0.16); the top is always right."""
    from eval.cascade_eval import TierSpec, evaluate
    from eval.cascade_fit import fit_with_guarantee
    from tests.eval.test_eval_cascade import row, yes

    rows = [row(i, "yes") for i in range(300)] + [row(i, "no") for i in range(300, 600)]

    def tiers() -> list[TierSpec]:
        cheap = TierSpec("cheap", "encoder", {r.id: yes(0.95 if r.answer == "yes" else 0.58) for r in rows}, per_call=1)
        top = TierSpec("top", "recorded", {r.id: yes(0.99 if r.answer == "yes" else 0.01) for r in rows}, per_call=10)
        return [cheap, top]

    specs = tiers()
    cert = fit_with_guarantee(specs, rows, ("of_top", 0.95), 0.1)
    assert cert.knob == 0.16 and specs[0].thresholds["yes_no"] == 0.16  # the lowest that escalates the unsure (0.15999)
    [report] = evaluate(specs, rows)
    assert report.cascade == 1.0 and report.past_first == 0.5
    specs = tiers()
    cert = fit_with_guarantee(specs, rows, ("escalation", 0.6), 0.1)  # half escalate from 0.16 up: certified
    assert cert.knob == 0.89  # from 0.9 (the sure rows: 0.8999) every row escalates: 100% > 60%
    specs = tiers()
    assert fit_with_guarantee(specs, rows, ("escalation", 0.4), 0.1).knob == 0.15  # 0.4 < 0.5: the unsure kept
    specs = tiers()
    cert = fit_with_guarantee(specs, rows[:8], ("of_top", 0.99), 0.1)
    assert cert.refused and specs[0].thresholds["yes_no"] == 1.0  # refused: everything to the top
