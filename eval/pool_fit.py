"""Fitting a pool's decision on dev rows, and replaying it over recorded answers (issue 56). Pure:
arrays in, arrays out; the benchmark (``benchmarks/pool.py``) reads the data and prices.

- :func:`fit_agreement`: how far the votes are trusted (:class:`policies.pool.Agreement`): the
  tempering that maximises the log-likelihood of the right option over states of the dev rows, then
  Platt scaling of the top option's probability on the same states. States: random sets of 1 to 4
  models' answers per row, then refitted with (:func:`visited`) the states the decision itself
  reaches on the dev rows over the knob's range.
- :func:`priors`: each model's P(right) per row from the dev rows alone: its accuracy, or its
  accuracy in the row's category (shrunk to the overall one), out of fold on the dev rows.
- :func:`chain`: a fixed chain (cheapest first) stopped at the first confidence over a threshold.
- :func:`outcome`: what a replay cost and whether it was right, per row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from policies.pool import NO_ANSWER, Agreement, base_weight, decide, vote_weight, votes
from policies.pool_routing import replay

TEMPERS = tuple(round(x, 2) for x in np.linspace(0.2, 1.5, 14))
SPREADS = (0.0, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # 0: every other option
SHRINK = 20.0  # pseudo-rows of the overall accuracy in a category's
FOLDS = 5


def folds(ids: Sequence[str], k: int = FOLDS, salt: str = "triage-pool-folds") -> np.ndarray:
    return np.array([int.from_bytes(hashlib.sha256(f"{salt}:{i}".encode()).digest()[:4], "big") % k for i in ids])


def _category_table(right: np.ndarray, cats: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    overall = np.nanmean(np.where(np.isnan(right), 0.0, right), axis=0)
    table = {}
    c = np.asarray(cats)
    for cat in set(cats):
        m = c == cat
        seen = np.nan_to_num(right[m], nan=0.0)
        table[cat] = (seen.sum(axis=0) + SHRINK * overall) / (m.sum() + SHRINK)
    return overall, table


def priors(
    kind: str,
    dev_right: np.ndarray,
    dev_cats: Sequence[str],
    dev_ids: Sequence[str],
    test_cats: Sequence[str],
) -> tuple[np.ndarray, np.ndarray]:
    """(dev rows' priors out of fold, test rows' priors from every dev row): ``kind`` "accuracy"
    (each model's accuracy on dev rows) or "category" (its accuracy in the row's category, shrunk
    towards the overall by :data:`SHRINK` rows). A model's missing answer counts as wrong."""

    def table(right: np.ndarray, cats: Sequence[str], rows: Sequence[str]) -> np.ndarray:
        overall, per = _category_table(right, cats)
        if kind == "accuracy":
            return np.tile(overall, (len(rows), 1))
        return np.array([per.get(c, overall) for c in rows])

    fold = folds(dev_ids)
    dev = np.zeros(dev_right.shape)
    cats = np.asarray(dev_cats)
    for f in range(FOLDS):
        inside = fold != f
        dev[~inside] = table(dev_right[inside], list(cats[inside]), list(cats[~inside]))
    return dev, table(dev_right, dev_cats, test_cats)


def _states(recorded: np.ndarray, rng: np.random.Generator, draws: int, sizes: Sequence[int]) -> np.ndarray:
    """(draws * rows, models) masks: random sets of ``sizes`` models per row."""
    rows, models = recorded.shape
    out = []
    for _ in range(draws):
        n = rng.choice(np.asarray(sizes), rows)
        keys = rng.random((rows, models))
        ranks = keys.argsort(axis=1).argsort(axis=1)
        out.append(ranks < n[:, None])
    return np.concatenate(out)


def visited(
    recorded: np.ndarray,
    p: np.ndarray,
    cost: np.ndarray,
    k: np.ndarray,
    ag: Agreement,
    knobs: Sequence[float],
) -> tuple[np.ndarray, np.ndarray]:
    """The states the decision reaches on these rows over ``knobs``: (masks of the models asked,
    the row of each), every prefix of every replay, repeated ones once."""
    bits = 1 << np.arange(recorded.shape[1], dtype=np.int64)
    keys = []
    for knob in knobs:
        asked_at, _, _ = replay(recorded, p, cost, k, ag, knob)
        for turn in range(int(asked_at.max()) + 1):
            mask = (asked_at >= 0) & (asked_at <= turn)
            keep = (asked_at == turn).any(axis=1)
            keys.append(np.stack([np.flatnonzero(keep), (mask[keep] * bits).sum(axis=1)], axis=1))
    unique = np.unique(np.concatenate(keys), axis=0)
    return (unique[:, 1:2] & bits) > 0, unique[:, 0]


def _fit_platt(x: np.ndarray, y: np.ndarray, steps: int = 50) -> tuple[float, float]:
    """Logistic regression of ``y`` on ``x`` (one feature) by Newton's method, a little ridge."""
    a, b = 1.0, 0.0
    for _ in range(steps):
        s = 1.0 / (1.0 + np.exp(-np.clip(a * x + b, -30, 30)))
        g = np.array([((s - y) * x).sum() + 1e-3 * (a - 1.0), (s - y).sum()])
        w = s * (1 - s)
        h = np.array([[(w * x * x).sum() + 1e-3, (w * x).sum()], [(w * x).sum(), w.sum() + 1e-9]])
        da, db = np.linalg.solve(h, g)
        a, b = a - da, b - db
        if abs(da) + abs(db) < 1e-9:
            break
    return float(a), float(b)


def fit_on(
    masks: np.ndarray, rows: np.ndarray, recorded: np.ndarray, p: np.ndarray, gold: np.ndarray, k: np.ndarray
) -> Agreement:
    """The spread and the tempering (a grid, by the right option's log-likelihood), then the Platt
    scaling of the top option's probability, on the states ``masks`` of ``rows``."""
    answers = np.where(masks & (recorded[rows] >= 0), recorded[rows], NO_ANSWER)
    kk = k[rows]
    width = int(kk.max())
    keep = (answers >= 0).any(axis=1)
    answers, kk, g, pr = answers[keep], kk[keep], gold[rows][keep], p[rows][keep]

    def loglik(z: np.ndarray) -> float:
        z = z - z.max(axis=1, keepdims=True)
        return float((z[np.arange(len(z)), g] - np.log(np.exp(z).sum(axis=1))).mean())

    def z_of(t: float, sp: float) -> np.ndarray:
        return votes(answers, vote_weight(pr, kk, t, sp), kk, width, base_weight(kk, len(kk), t, sp))

    tried = [(loglik(z_of(t, sp)), t, sp) for sp in SPREADS for t in TEMPERS]
    _, temper, spread = max(tried)
    z = z_of(temper, spread)
    top = np.exp(z - z.max(axis=1, keepdims=True))
    top = top / top.sum(axis=1, keepdims=True)
    chosen = top.argmax(axis=1)
    t = np.clip(top.max(axis=1), 1e-4, 1 - 1e-4)
    a, b = _fit_platt(np.log(t) - np.log1p(-t), (chosen == g).astype(np.float64))
    return Agreement(temper=temper, a=a, b=b, spread=spread)


def fit_agreement(
    recorded: np.ndarray,
    p: np.ndarray,
    gold: np.ndarray,
    k: np.ndarray,
    cost: np.ndarray,
    knobs: Sequence[float],
    seed: int = 56,
) -> Agreement:
    """Fitted on dev rows: first on random states (1 to 4 models), then on those and the states the
    decision reaches with that fit over ``knobs``."""
    rng = np.random.default_rng(seed)
    masks = _states(recorded, rng, 4, (1, 2, 3, 4))
    rows = np.tile(np.arange(len(recorded)), 4)
    first = fit_on(masks, rows, recorded, p, gold, k)
    seen, at = visited(recorded, p, cost, k, first, knobs)
    return fit_on(np.concatenate([masks, seen]), np.concatenate([rows, at]), recorded, p, gold, k)


def chain(
    recorded: np.ndarray,
    p: np.ndarray,
    k: np.ndarray,
    order: Sequence[int],
    ag: Agreement,
    threshold: float,
    combine: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """A fixed chain: ask ``order``'s models in turn, stop at the first calibrated confidence at
    least ``threshold`` (the votes so far with ``combine``; else the answer of the model just asked,
    at its own prior). (asked (rows, models), answer)."""
    rows, models = recorded.shape
    width = int(k.max())
    w = vote_weight(np.nan_to_num(p, nan=0.0), k, ag.temper, ag.spread)
    base = base_weight(k, rows, ag.temper, ag.spread)
    asked = np.zeros((rows, models), dtype=bool)
    answer = np.zeros(rows, dtype=np.int64)
    live = np.ones(rows, dtype=bool)
    for i, m in enumerate(order):
        idx = np.flatnonzero(live)
        asked[idx, m] = True
        if combine:
            given = asked[idx] & (recorded[idx] >= 0)
            z = votes(np.where(given, recorded[idx], NO_ANSWER), w[idx], k[idx], width, base[idx])
        else:
            only = np.full((len(idx), models), NO_ANSWER)
            only[:, m] = recorded[idx, m]
            z = votes(only, w[idx], k[idx], width, base[idx])
        a, conf = decide(z, ag)
        if not combine:  # no answer from this model: fall back on the last that answered
            a = np.where(recorded[idx, m] >= 0, a, answer[idx])
        answer[idx] = a
        stop = (conf >= threshold) | (i == len(order) - 1)
        live[idx[stop]] = False
    return asked, answer


@dataclass(frozen=True)
class Outcome:
    right: np.ndarray  # per row, 1.0 / 0.0
    cost: np.ndarray  # per row, what the models asked cost
    calls: np.ndarray  # per row, how many were asked


def outcome(asked: np.ndarray, answer: np.ndarray, gold: np.ndarray, cost: np.ndarray) -> Outcome:
    """``asked``: a mask, or when each model was asked (-1: never, as :func:`policies.pool_routing.replay`)."""
    if asked.dtype != bool:
        asked = asked >= 0
    c = np.broadcast_to(cost, asked.shape)
    return Outcome((answer == gold).astype(np.float64), (asked * c).sum(axis=1), asked.sum(axis=1).astype(np.float64))
