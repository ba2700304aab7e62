"""Fitting agreement as a tier's confidence on dev rows (issue 56; :mod:`policies.agreement`), for
``triage eval``: where a policy's tier has ``agreement`` for a question type, every tier's accuracy
for that type (its answer's weight as a vote: right on the dev rows it answered) and the tier's
agreement (the votes' tempering, spread and Platt scaling, :func:`eval.pool_fit.fit_on`) on the
states the cascade reaches it in: the answers of every tier up to it. ``own_temper`` is kept as the
policy gives it (not fitted)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from eval.cascade_eval import TierSpec
from eval.pool_fit import fit_on
from eval.tier_outputs import Row
from policies.pool import NO_ANSWER

MIN_ROWS = 20  # fewer dev rows of a type: the policy's numbers are kept


def fit_agreements(tiers: Sequence[TierSpec], dev: Sequence[Row]) -> None:
    """Each tier's ``accuracy`` and each agreeing tier's ``agreement``, per type, in place."""
    types = sorted({q for t in tiers for q in t.agreement})
    for qtype in types:
        rows = [r for r in dev if r.question.type == qtype and not r.question.numeric]
        if len(rows) < MIN_ROWS:
            continue
        answers = np.full((len(rows), len(tiers)), NO_ANSWER, dtype=np.int64)
        for j, t in enumerate(tiers):
            for n, r in enumerate(rows):
                if (rd := t.reading(r)) is not None:
                    answers[n, j] = r.question.options.index(rd.answer)
        gold = np.array([r.question.options.index(r.answer) for r in rows])
        k = np.array([len(r.question.options) for r in rows])
        given = answers >= 0
        right = ((answers == gold[:, None]) & given).sum(axis=0)
        acc = np.clip((right + 1.0) / (given.sum(axis=0) + 2.0), 0.01, 0.99)  # Laplace: a tier never sure
        for j, t in enumerate(tiers):
            if given[:, j].any():
                t.accuracy[qtype] = round(float(acc[j]), 4)
        p = np.tile(acc, (len(rows), 1))
        for i, t in enumerate(tiers):
            if qtype not in t.agreement:
                continue
            prefix = np.zeros((len(rows), len(tiers)), dtype=bool)
            prefix[:, : i + 1] = True
            fitted = fit_on(prefix, np.arange(len(rows)), answers, p, gold, k)
            own = t.agreement[qtype].own_temper
            t.agreement[qtype] = dataclasses.replace(fitted, own_temper=own)
