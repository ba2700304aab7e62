"""A pool's decision (policies/pool.py, policies/pool_routing.py) and its fitting (eval/pool_fit.py):
fast, synthetic, no model."""

from __future__ import annotations

import numpy as np
import pytest

from eval.pool_fit import chain, fit_agreement, outcome, priors
from policies.pool import NO_ANSWER, Agreement, decide, vote_weight, votes
from policies.pool_routing import expected_gain, lookahead, next_model, replay, step

PLAIN = Agreement()


def test_a_vote_weighs_nothing_at_chance_and_more_with_accuracy() -> None:
    w = vote_weight(np.array([[0.25, 0.5, 0.9, 0.1]]), 4)
    assert w[0, 0] == pytest.approx(0.0) and w[0, 3] == pytest.approx(0.0)  # at or under chance: no vote
    assert 0 < w[0, 1] < w[0, 2]
    assert vote_weight(np.array([[0.9]]), 4, temper=0.5)[0, 0] == pytest.approx(w[0, 2] / 2)


def test_two_cheap_answers_that_agree_are_surer_than_one_and_than_two_that_differ() -> None:
    p = np.array([[0.6, 0.6]])
    w = vote_weight(p, 4)
    one = decide(votes(np.array([[2, NO_ANSWER]]), w, 4, 4), PLAIN)
    agree = decide(votes(np.array([[2, 2]]), w, 4, 4), PLAIN)
    differ = decide(votes(np.array([[2, 1]]), w, 4, 4), PLAIN)
    assert one[0][0] == agree[0][0] == 2
    assert agree[1][0] > one[1][0] > differ[1][0]
    assert one[1][0] == pytest.approx(0.6)  # one answer alone: its own prior


def test_a_tiers_own_probabilities_combine_with_the_votes() -> None:
    w = vote_weight(np.array([[0.6]]), 3)
    own = np.log(np.array([[0.1, 0.2, 0.7]]))
    against = decide(votes(np.array([[0]]), w, 3, 3, own_logp=own), PLAIN)
    assert against[0][0] == 2  # the scorer's 0.7 outweighs a 0.6 vote for option 0
    assert decide(votes(np.array([[2]]), w, 3, 3, own_logp=own), PLAIN)[1][0] > 0.8
    # options beyond a row's count are never chosen
    z = votes(np.array([[NO_ANSWER]]), w, np.array([2]), 4)
    assert np.isneginf(z[0, 2:]).all()


def test_asking_gains_where_the_answer_can_change_the_decision() -> None:
    p = np.array([[0.6, 0.95, 0.3]])
    w = vote_weight(p, 4)
    start = votes(np.array([[NO_ANSWER] * 3]), w, 4, 4)
    gain = expected_gain(start, w, p, PLAIN)
    assert gain[0, 1] > gain[0, 0] > gain[0, 2] > 0  # from nothing: each model's lift over chance
    assert gain[0, 1] == pytest.approx(0.95 - 0.25)
    sure = votes(np.array([[NO_ANSWER, 1, NO_ANSWER]]), w, 4, 4)
    after = expected_gain(sure, w, p, PLAIN)
    assert after[0, 2] == pytest.approx(0.0, abs=1e-9)  # a weak vote cannot overturn a 0.95 answer
    assert (after >= -1e-9).all()  # a consistent posterior: information never lowers the expected accuracy


def test_the_next_model_is_the_one_worth_most_if_it_is_worth_more_than_stopping() -> None:
    value = np.array([[0.7, 0.9, -np.inf]])
    assert next_model(value, np.array([0.5]))[0] == 1
    assert next_model(value, np.array([0.95]))[0] == -1  # stopping is worth more
    assert next_model(value, np.array([0.95]), must=np.array([True]))[0] == 1
    assert next_model(np.full((1, 3), -np.inf), np.array([0.0]), must=np.array([True]))[0] == -1  # none left


def test_two_steps_ahead_a_second_cheap_answer_is_worth_its_check() -> None:
    p = np.array([[0.6, 0.55, 0.9]])
    cost = np.array([1.0, 1.0, 20.0])
    w = vote_weight(p, 4)
    one = votes(np.array([[2, NO_ANSWER, NO_ANSWER]]), w, 4, 4)
    asked = np.array([[True, False, False]])
    gain = expected_gain(one, w, p, PLAIN)
    assert gain[0, 1] == pytest.approx(0.0, abs=1e-9)  # one step ahead: it cannot overturn the first
    value = lookahead(one, p, w, cost, asked, PLAIN, 0.005)
    now = decide(one, PLAIN)[1][0]
    assert value[0, 1] > value[0, 2] and value[0, 1] > now  # two steps: agreement may spare the top
    assert np.isneginf(value[0, 0])


def _pool(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A cheap model right on 60%, a second cheap one on 55% (errors spread), a top one on 90%."""
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, 4, n)
    acc = np.array([0.6, 0.55, 0.9])
    right = rng.random((n, 3)) < acc
    wrong = (gold[:, None] + rng.integers(1, 4, (n, 3))) % 4
    return np.where(right, gold[:, None], wrong), gold, acc


def test_cascade_routing_asks_the_cheap_pair_and_escalates_where_they_disagree() -> None:
    answers, gold, acc = _pool(1500)
    cost = np.array([1.0, 1.0, 20.0])
    p = np.tile(acc, (len(gold), 1))
    asked_all = replay(answers, p, cost, 4, PLAIN, 0.0)[0] >= 0
    assert asked_all[:, 2].all()  # knob 0: the most trusted, whatever it costs
    asked_at, answer, conf = replay(answers, p, cost, 4, PLAIN, 0.02)
    asked = asked_at >= 0
    assert (asked_at[asked[:, 2], 2] == 2).all()  # the top only after the pair
    cheap_first = asked[:, :2].all(axis=1) & ~asked[:, 2]
    assert 0.2 < cheap_first.mean() < 0.8  # the pair agreed often enough to stop there
    agreed = answers[:, 0] == answers[:, 1]
    assert (asked[:, 2] | agreed).all()  # the top is asked wherever the pair disagreed
    got = outcome(asked, answer, gold, cost)
    assert got.right.mean() > 0.85 and got.cost.mean() < 0.7 * 22.0
    assert (conf >= 0).all() and (conf <= 1).all()
    stop = replay(answers, p, cost, 4, PLAIN, 1e9)[0] >= 0
    assert (stop.sum(axis=1) == 1).all()  # a decision asks one model whatever the knob


def test_without_agreement_only_the_most_trusted_answer_counts() -> None:
    answers = np.array([[1, 1, 3]])
    p = np.array([[0.6, 0.6, 0.7]])
    asked = np.array([[True, True, True]])
    _, answer, _ = step(asked, answers, p, np.ones(3), 4, PLAIN, 0.0)
    assert answer[0] == 1  # two votes of 0.6 beat one of 0.7
    _, plain, conf = step(asked, answers, p, np.ones(3), 4, PLAIN, 0.0, combine=False)
    assert plain[0] == 3 and conf[0] == pytest.approx(0.7)


def test_a_chain_stops_at_its_threshold_with_or_without_agreement() -> None:
    answers, gold, acc = _pool(2000, seed=1)
    p = np.tile(acc, (len(gold), 1))
    k = np.full(len(gold), 4)
    asked, _ = chain(answers, p, k, [0, 1, 2], PLAIN, 0.75)
    assert asked[:, 0].all() and not asked[:, 2].all()
    plain, _ = chain(answers, p, k, [0, 1, 2], PLAIN, 0.75, combine=False)
    assert plain[:, 2].all()  # neither cheap model is 0.75 sure alone
    assert chain(answers, p, k, [0, 1, 2], PLAIN, 0.0)[0][:, 1:].sum() == 0


def test_errors_shared_between_models_are_tempered_on_dev_rows() -> None:
    rng = np.random.default_rng(3)
    n, k = 800, 10
    gold = rng.integers(0, k, n)
    lure = (gold + 1 + rng.integers(0, k - 1, n)) % k  # one distractor per question, shared by every model
    right = rng.random((n, 4)) < 0.6
    answers = np.where(right, gold[:, None], lure[:, None])
    p = np.full((n, 4), 0.6)
    cost = np.ones(4)
    ag = fit_agreement(answers, p, gold, np.full(n, k), cost, (0.0,))
    # independence would count a shared lure as independent evidence: wrong answers gather on one option
    assert ag.spread <= 1.5
    assert ag.a > 0


def test_priors_are_out_of_fold_on_dev_rows() -> None:
    right = np.array([[1.0, 0.0]] * 50 + [[0.0, 1.0]] * 50)
    cats = ["a"] * 50 + ["b"] * 50
    ids = [f"r{i}" for i in range(100)]
    dev, test = priors("category", right, cats, ids, ["a", "b"])
    assert test[0, 0] > 0.7 and test[1, 1] > 0.7  # the category's accuracy, shrunk towards 0.5
    assert dev.shape == right.shape and (dev[:50, 0] > dev[:50, 1]).all()
    _, flat = priors("accuracy", right, cats, ids, ["a", "b"])
    assert np.allclose(flat, 0.5)  # each model's accuracy over every dev row
