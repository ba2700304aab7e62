"""A pool of models as one decision (issue 56): the answers so far as a vote, and the next model
chosen by what it is expected to add for its cost. Pure (numpy only), batched over rows (one row is
a request).

**Agreement as confidence.** A question has ``k`` options (indices ``0..k-1``). A model with
P(right) ``p`` (its prior for this question: the learned router's quality head, or its accuracy on
dev rows) that answers option ``j`` is, under independence with its wrong answers spread over the
other options, a vote of weight ``log(p (k - 1) / (1 - p))`` for ``j``: the posterior over the
options is the softmax of the votes' sums. Models err together (a shared distractor, one family):
two wrong answers to a 10-option MMLU-Pro question agree 35-55% of the time, not 1 in 9. So a
wrong answer is taken to spread over ``spread`` options, not ``k - 1`` (a model under ``1 / (1 +
spread)`` then casts no vote: weak models stop outvoting strong ones), every vote is tempered by
``temper``, and the posterior's top probability is calibrated (Platt: ``a * logit + b``), all
fitted per question type on dev rows (:class:`Agreement`; ``eval/pool_fit.py``). A tier with its
own probabilities over the options (a local scorer) adds ``own_temper * log(probabilities)`` to
the votes: the two combine. Two cheap answers that agree lift the confidence; a model that gives
no answer adds nothing.

The next model to ask, given the votes so far: :mod:`policies.pool_routing`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NO_ANSWER = -1
EPS = 1e-4


@dataclass(frozen=True)
class Agreement:
    """How far votes are trusted, fitted per question type on dev rows."""

    temper: float = 1.0  # each model's vote weight is multiplied by this (errors shared across models: < 1)
    own_temper: float = 1.0  # ... a tier's own log-probabilities by this
    a: float = 1.0  # the top option's calibrated P(right) = sigmoid(a * logit(posterior) + b)
    b: float = 0.0
    spread: float = 0.0  # the options a wrong answer spreads over (0: all the other k - 1)

    def to_json(self) -> dict[str, float]:
        return {"temper": self.temper, "own_temper": self.own_temper, "a": self.a, "b": self.b, "spread": self.spread}

    @classmethod
    def from_json(cls, doc: dict[str, float]) -> Agreement:
        t, o, a, b = (float(doc[f]) for f in ("temper", "own_temper", "a", "b"))
        return cls(t, o, a, b, float(doc.get("spread", 0.0)))


def per_row(k: np.ndarray | int, rows: int) -> np.ndarray:
    """``k`` (a number, or one a row) as one float a row."""
    return np.broadcast_to(np.asarray(k, dtype=np.float64), (rows,)).astype(np.float64)


def wrong_options(k: np.ndarray, spread: float) -> np.ndarray:
    """The options a wrong answer spreads over: ``spread``, at most ``k - 1`` (0: ``k - 1``)."""
    return k - 1.0 if spread <= 0 else np.minimum(spread, k - 1.0)


def vote_weight(p: np.ndarray, k: np.ndarray | int, temper: float = 1.0, spread: float = 0.0) -> np.ndarray:
    """The weight of an answer from a model right with probability ``p`` among ``k`` options (rows
    first; ``p`` (rows, models)), its wrong answers spread over ``spread`` options (0: ``k - 1``):
    ``temper * log(p spread / (1 - p))``, 0 at that chance and never below (a worse prior is no vote)."""
    p = np.atleast_2d(np.asarray(p, dtype=np.float64))
    kk = per_row(k, p.shape[0])[:, None]
    wrong = wrong_options(kk, spread)
    p = np.clip(p, 1.0 / (wrong + 1.0), 1.0 - EPS)
    out: np.ndarray = temper * (np.log(p) + np.log(wrong) - np.log1p(-p))
    return out


def base_weight(k: np.ndarray | int, rows: int, temper: float = 1.0, spread: float = 0.0) -> np.ndarray:
    """(rows,) the votes of an option no model named: ``temper * log(spread / (k - 1))`` (0 with
    errors spread over every option; below 0 where they gather), so that one answer of a model
    right with ``p`` leaves its option at ``p``."""
    kk = per_row(k, rows)
    return temper * np.log(wrong_options(kk, spread) / (kk - 1.0))


def option_mask(k: np.ndarray | int, rows: int, width: int) -> np.ndarray:
    """(rows, width): True where the option exists."""
    return np.arange(width)[None, :] < per_row(k, rows)[:, None]


def named(answers: np.ndarray, width: int) -> np.ndarray:
    """(rows, width): the options some answer named."""
    answers = np.atleast_2d(answers)
    out = np.zeros((answers.shape[0], width), dtype=bool)
    r, m = np.nonzero(answers >= 0)
    out[r, answers[r, m]] = True
    return out


def votes(
    answers: np.ndarray,
    weights: np.ndarray,
    k: np.ndarray | int,
    width: int,
    base: np.ndarray | None = None,
    own_logp: np.ndarray | None = None,
    own_temper: float = 1.0,
) -> np.ndarray:
    """(rows, width) summed votes: ``answers`` (rows, models) option indices (``NO_ANSWER``: none yet,
    or none given), ``weights`` (rows, models) from :func:`vote_weight`, ``base`` (rows,) an unnamed
    option's (:func:`base_weight`; default 0); ``own_logp`` (rows, width): a tier's own
    log-probabilities, NaN where it has none. Options beyond a row's ``k``: -inf."""
    answers = np.atleast_2d(answers)
    rows = answers.shape[0]
    z = np.zeros((rows, width))
    given = answers >= 0
    r, m = np.nonzero(given)
    np.add.at(z, (r, answers[r, m]), np.broadcast_to(weights, answers.shape)[r, m])
    if base is not None:
        z = np.where(named(answers, width), z, np.asarray(base, dtype=np.float64)[:, None])
    if own_logp is not None:
        own = np.nan_to_num(np.asarray(own_logp, dtype=np.float64), nan=0.0, neginf=np.log(EPS))
        z = z + own_temper * own
    return np.where(option_mask(k, rows, width), z, -np.inf)


def posterior(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=1, keepdims=True)
    return out


def calibrated(top: np.ndarray, ag: Agreement) -> np.ndarray:
    """P(the top option is right) from the posterior's top probability: ``sigmoid(a logit(top) + b)``."""
    top = np.clip(top, EPS, 1 - EPS)
    if ag.a == 1.0 and ag.b == 0.0:
        return top
    out: np.ndarray = 1.0 / (1.0 + np.exp(-ag.b) * ((1.0 - top) / top) ** ag.a)
    return out


def decide(z: np.ndarray, ag: Agreement) -> tuple[np.ndarray, np.ndarray]:
    """(the answer: the posterior's top option, its calibrated confidence), per row."""
    post = posterior(z)
    return post.argmax(axis=1), calibrated(post.max(axis=1), ag)
