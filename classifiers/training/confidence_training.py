"""Fitting a tier's confidence model (:mod:`classifiers.confidence`) on labeled dev rows.

Variants are chosen by out-of-fold log-loss on the rows given (never test rows): the scalar
signals alone, and where every row has the question's embedding, with the neighbour statistics
(the held-out rows' neighbours taken among the other folds' rows only) or with the raw vector,
each at a few regularisation strengths. The chosen variant's out-of-fold log-odds fit a Platt calibration
(and one per question type with enough rows: a yes/no answer's odds do not mean a choice's);
the final regression is refitted on all rows. The out-of-fold probabilities are returned too, so
a caller that fits thresholds on the same rows does not fit them to the model's own training fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from classifiers.calibration import auroc
from classifiers.confidence import ConfidenceModel, neighbour_stats, scalars
from policies.cascade import Signals

MIN_ROWS = 40
MIN_TYPE_ROWS = 40  # a question type's own Platt calibration needs this many rows, both classes among them
C_SCALARS = (0.1, 1.0, 10.0)
C_EMBEDDING = (0.0003, 0.001, 0.003)  # the raw vector's 384 standardised columns overfit easily
K, PRIOR = 32, 8.0


@dataclass(frozen=True)
class Fitted:
    model: ConfidenceModel
    out_of_fold: np.ndarray  # P(right) per row, each from a model that did not see it
    tried: tuple[tuple[str, float, float], ...]  # (variant, C, out-of-fold log-loss)
    auroc_raw: float  # the tier's own top probability, on these rows
    auroc: float  # the out-of-fold P(right)


def _folds(y: np.ndarray, k: int, seed: int) -> list[np.ndarray]:
    """Stratified folds by a seeded permutation (the same on every machine)."""
    rng = np.random.default_rng(seed)
    out: list[list[int]] = [[] for _ in range(k)]
    for label in (0, 1):
        idx = rng.permutation(np.flatnonzero(y == label))
        for j, i in enumerate(idx):
            out[j % k].append(int(i))
    return [np.array(sorted(f), dtype=int) for f in out]


def _standardise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale < 1e-8] = 1.0
    return mean, scale


def _fit_lr(x: np.ndarray, y: np.ndarray, c: float) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    from sklearn.linear_model import LogisticRegression

    mean, scale = _standardise(x)
    lr = LogisticRegression(C=c, max_iter=2000)
    lr.fit((x - mean) / scale, y)
    return lr.coef_[0].astype(np.float64), float(lr.intercept_[0]), mean, scale


def _log_odds(x: np.ndarray, fit: tuple[np.ndarray, float, np.ndarray, np.ndarray]) -> np.ndarray:
    w, b, mean, scale = fit
    return ((x - mean) / scale) @ w + b


def _log_loss(z: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(1 / (1 + np.exp(-np.clip(z, -40, 40))), 1e-6, 1 - 1e-6)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def _platt(z: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    from sklearn.linear_model import LogisticRegression

    lr = LogisticRegression(C=1e4, max_iter=1000)
    lr.fit(z[:, None], y)
    return float(lr.coef_[0][0]), float(lr.intercept_[0])


@dataclass(frozen=True)
class _Design:
    """The feature matrix of any rows, read against any reference rows (the neighbours variant)."""

    scalars: np.ndarray  # (n, len(SCALARS))
    embeddings: np.ndarray | None  # (n, d), unit rows
    y: np.ndarray

    def of(self, variant: str, rows: np.ndarray, reference: np.ndarray) -> np.ndarray:
        x = self.scalars[rows]
        if variant == "scalars":
            return x
        assert self.embeddings is not None
        if variant == "embedding":
            return np.hstack([x, self.embeddings[rows]])
        sims = self.embeddings[rows] @ self.embeddings[reference].T
        sims[rows[:, None] == reference[None, :]] = -np.inf  # a row is never its own neighbour
        ys = self.y[reference].astype(float)
        return np.hstack([x, neighbour_stats(sims, ys, K, PRIOR, float(ys.mean()))])


def fit_confidence(
    tier: str,
    signals: Sequence[Signals],
    right: Sequence[bool],
    folds: int = 5,
    seed: int = 0,
    after: Sequence[bool] | None = None,
) -> Fitted:
    """The tier's confidence model from its answers on labeled rows (``right[i]``: answer i was
    right; ``after[i]``: escalating, the last tier's answer, was right; kept with the rows'
    embeddings, where they have them, for :meth:`ConfidenceModel.p_after`)."""
    y = np.asarray(right, dtype=int)
    if len(y) < MIN_ROWS or y.min() == y.max():
        raise ValueError(
            f"tier '{tier}': a confidence model needs at least {MIN_ROWS} answered rows with both right and "
            f"wrong answers ({len(y)} rows, {int(y.sum())} right)"
        )
    embeddings = None
    variants: list[tuple[str, tuple[float, ...]]] = [("scalars", C_SCALARS)]
    if all(s.embedding is not None for s in signals):
        e = np.vstack([np.asarray(s.embedding, dtype=np.float64).ravel() for s in signals])
        embeddings = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-9)
        variants += [("neighbours", C_SCALARS), ("embedding", C_EMBEDDING)]
    design = _Design(np.vstack([scalars(s) for s in signals]), embeddings, y)
    everything = np.arange(len(y))
    parts = _folds(y, folds, seed)
    tried: list[tuple[str, float, float]] = []
    best: tuple[float, str, float, np.ndarray] | None = None
    for variant, cs in variants:
        for c in cs:
            z = np.zeros(len(y))
            for held in parts:
                keep = np.setdiff1d(everything, held)
                fit = _fit_lr(design.of(variant, keep, keep), y[keep], c)
                z[held] = _log_odds(design.of(variant, held, keep), fit)
            loss = _log_loss(z, y)
            tried.append((variant, c, round(loss, 5)))
            if best is None or loss < best[0]:
                best = (loss, variant, c, z)
    assert best is not None
    _, variant, c, z = best
    a, b = _platt(z, y)
    qtypes = np.array([s.qtype for s in signals])
    by_type: dict[str, tuple[float, float]] = {}
    for qtype in sorted(set(qtypes)):
        m = qtypes == qtype
        if m.sum() >= MIN_TYPE_ROWS and 0 < y[m].sum() < m.sum():
            by_type[str(qtype)] = _platt(z[m], y[m])
    w, bias, mean, scale = _fit_lr(design.of(variant, everything, everything), y, c)
    slope = np.array([by_type.get(str(t), (a, b))[0] for t in qtypes])
    shift = np.array([by_type.get(str(t), (a, b))[1] for t in qtypes])
    oof = 1 / (1 + np.exp(-np.clip(slope * z + shift, -40, 40)))
    raw_top = design.scalars[:, 0]
    meta = {"variant": variant, "C": c, "rows": len(y), "right": int(y.sum()), "folds": folds}
    neighbours = variant == "neighbours" and embeddings is not None
    kept_after = after is not None and embeddings is not None
    model = ConfidenceModel(
        tier,
        w,
        bias,
        mean,
        scale,
        variant,  # type: ignore[arg-type]
        (a, b),
        meta,
        embeddings if neighbours or kept_after else None,
        y.astype(np.float64) if neighbours else None,
        K,
        PRIOR,
        np.asarray(after, dtype=np.float64) if kept_after and after is not None else None,
        by_type,
    )
    return Fitted(model, oof, tuple(tried), auroc(raw_top, y), auroc(oof, y))
