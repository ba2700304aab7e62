"""Agreement as a cascade tier's confidence (issue 56), for one question as the cascade asks it.
Pure: the votes of :mod:`policies.pool`, read for one request.

A tier whose policy gives ``agreement`` for the question's type does not keep its answer on its own
confidence: every tier that answered so far (itself included) casts a vote for its option, weighted by
that tier's ``accuracy`` for the type (its P(right) on dev rows; a tier with none casts no vote), and
the tier's confidence is the calibrated top probability of the votes' posterior, its answer that top
option. A tier that returned probabilities (the scorer, a model with logprobs) may add them too
(``own_temper`` > 0); one that returned none (an assumed confidence) counts by its vote alone. So a
model that gives no probabilities gets a measured confidence: how often its answer, agreeing or not
with the tiers before it, was right on dev rows (``eval/pool_fit.py`` fits the numbers; ``python -m
benchmarks pool`` measures them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from policies.pool import NO_ANSWER, Agreement, base_weight, calibrated, posterior, vote_weight, votes


@dataclass(frozen=True)
class Vote:
    """One tier's answer as a vote."""

    tier: str
    answer: str  # one of the question's options
    accuracy: float | None  # the tier's P(right) for the question's type; None: it casts no vote
    probabilities: Mapping[str, float] | None = None  # its measured probabilities (None: it gave none)


@dataclass(frozen=True)
class Agreed:
    answer: str
    probabilities: dict[str, float]  # the votes' posterior (before calibration), per option
    confidence: float  # the calibrated P(the answer is right)
    agreeing: tuple[str, ...]  # the tiers whose answer it is


def agree(options: Sequence[str], ballot: Sequence[Vote], ag: Agreement) -> Agreed:
    """The answer the votes so far pick among ``options`` and its calibrated confidence."""
    if not ballot:
        raise ValueError("agreement needs at least one answer")
    k = len(options)
    index: dict[str, int] = {}
    for i, o in enumerate(options):  # a repeated option text: its first place
        index.setdefault(o, i)
    answers = np.array([[index[v.answer] if v.accuracy is not None else NO_ANSWER for v in ballot]])
    p = np.array([[np.nan if v.accuracy is None else v.accuracy for v in ballot]])
    weights = np.where(np.isnan(p), 0.0, vote_weight(np.nan_to_num(p, nan=0.5), k, ag.temper, ag.spread))
    own = None
    if ag.own_temper > 0:
        measured = [v.probabilities for v in ballot if v.probabilities is not None]
        if measured:
            logp = [np.log(np.clip([m.get(o, 0.0) for o in options], 1e-4, 1.0)) for m in measured]
            own = np.sum(logp, axis=0)[None, :]
    z = votes(answers, weights, k, k, base_weight(k, 1, ag.temper, ag.spread), own, ag.own_temper)
    post = posterior(z)[0]
    tied = np.flatnonzero(post >= post.max() - 1e-12)
    last = index[ballot[-1].answer]
    top = int(last if last in tied else tied[0])  # a tie goes to the answer of the tier asked last
    merged: dict[str, float] = {}
    for o, q in zip(options, post, strict=True):
        merged[o] = merged.get(o, 0.0) + float(q)
    conf = float(calibrated(np.array([post[top]]), ag)[0])
    answer = options[top]
    return Agreed(answer, merged, conf, tuple(v.tier for v in ballot if v.answer == answer))
