"""Fit the quality heads of :mod:`classifiers.quality` on dev rows of a labels file, choosing the
learner by held-back dev rows (never test rows).

Learners tried (each a candidate every ``triage train`` measures again, see docs/router.md):
``linear`` (logistic regression per model), ``mf`` (a shared rank-r projection with a vector per
model, fitted jointly by Adam on the log-loss: matrix factorisation, as RouteLLM's MF router),
``knn`` (k nearest dev prompts, with shrinkage), ``centroid`` (a soft category table, where the
labels file has categories) and ``blend``, the mean of the best linear-shaped and the best knn.
Where the policy's prices are known, the one with the best routing value on the held-back rows
wins (:func:`routing_value`: the gap between the cheapest and the most accurate model the router
closes, averaged over the money between them); without prices, the highest mean AUROC of P(right)
(log-loss, dominated by each model's base rate, could not tell the learners apart: 0.5010 to
0.5013 on RouteLLM's MMLU). Per-model AUROC is a proxy: on MMLU-Pro's 29 models it chose a blend
whose routing was worse than the centroid table's. The winner is refitted on every dev row but the
calibration share, and Platt-calibrated on that share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from classifiers.calibration import auroc, ece
from classifiers.quality import Kind, QualityHead, centroid_proba, knn_proba, logit, sigmoid
from classifiers.training.fit import held_back
from policies.routed import knob_grid, outcome, prune

LINEAR_C = (0.05, 0.2, 1.0)
MF_RANKS = (8, 32)
KNN_K = (20, 50, 100, 200)
KNN_PRIOR = 10.0
CENTROID_T = (0.02, 0.05)
CATEGORY_PRIOR = 10.0


@dataclass
class Candidate:
    learner: str
    setting: str
    log_loss: float  # mean over models, held-back dev rows
    auroc: float  # mean over models
    value: float = float("nan")  # routing value (routing_value) on the held-back rows, where costs are known


@dataclass
class QualityFit:
    head: QualityHead
    tried: list[Candidate] = field(default_factory=list)


def _log_loss(p: np.ndarray, y: np.ndarray) -> float:
    known = ~np.isnan(y)
    p = np.clip(p[known], 1e-4, 1 - 1e-4)
    t = y[known]
    return float(-(t * np.log(p) + (1 - t) * np.log(1 - p)).mean())


def _mean_auroc(p: np.ndarray, y: np.ndarray) -> float:
    vals = []
    for j in range(y.shape[1]):
        known = ~np.isnan(y[:, j])
        t = y[known, j] > 0.5
        if t.any() and (~t).any():
            vals.append(auroc(p[known, j], t))
    return float(np.mean(vals)) if vals else float("nan")


def fit_linear(x: np.ndarray, y: np.ndarray, c: float) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.linear_model import LogisticRegression

    weight = np.zeros((y.shape[1], x.shape[1]), dtype=np.float32)
    bias = np.zeros(y.shape[1], dtype=np.float32)
    for j in range(y.shape[1]):
        known = ~np.isnan(y[:, j])
        t = y[known, j] > 0.5
        if t.all() or not t.any():
            bias[j] = logit(np.array([t.mean()]))[0]
            continue
        model = LogisticRegression(C=c, max_iter=2000).fit(x[known], t)
        weight[j], bias[j] = model.coef_[0], model.intercept_[0]
    return weight, bias


def fit_mf(
    x: np.ndarray, y: np.ndarray, rank: int, steps: int = 600, lr: float = 0.01, l2: float = 1e-3, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """P(right of model m | x) = sigmoid(u_m . (A x) + b_m), fitted jointly; returned multiplied out
    as a linear head (weight = U A)."""
    rng = np.random.default_rng(seed)  # a fixed seed: the same fit on every run
    _n, d = x.shape
    m = y.shape[1]
    known = ~np.isnan(y)
    t = np.nan_to_num(y)
    a = rng.normal(0, 1 / np.sqrt(d), (rank, d))
    u = rng.normal(0, 1 / np.sqrt(rank), (m, rank))
    b = logit(np.clip(np.nanmean(y, axis=0), 0.01, 0.99))
    params = [a, u, b]
    moments = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
    for step in range(1, steps + 1):
        h = x @ a.T
        z = h @ u.T + b
        g = (sigmoid(z) - t) * known / known.sum()
        grads = [(g @ u).T @ x + l2 * a, g.T @ h + l2 * u, g.sum(axis=0)]
        for i, (p, gr) in enumerate(zip(params, grads, strict=True)):
            m1, m2 = moments[i]
            m1[...] = 0.9 * m1 + 0.1 * gr
            m2[...] = 0.999 * m2 + 0.001 * gr * gr
            p -= lr * (m1 / (1 - 0.9**step)) / (np.sqrt(m2 / (1 - 0.999**step)) + 1e-8)
    return (u @ a).astype(np.float32), b.astype(np.float32)


def fit_centroids(x: np.ndarray, y: np.ndarray, categories: Sequence[str]) -> dict[str, np.ndarray]:
    """Per category: the unit mean embedding, and each model's accuracy there, shrunk towards its
    overall accuracy by ``CATEGORY_PRIOR`` pseudo-rows (no answer counts as wrong)."""
    cats = np.asarray(categories)
    names = sorted(set(categories))
    right = np.nan_to_num(y, nan=0.0)
    overall = right.mean(axis=0)
    cent = np.stack([x[cats == c].mean(axis=0) for c in names])
    cent /= np.linalg.norm(cent, axis=1, keepdims=True) + 1e-12
    acc = np.stack(
        [
            (right[cats == c].sum(axis=0) + CATEGORY_PRIOR * overall) / ((cats == c).sum() + CATEGORY_PRIOR)
            for c in names
        ]
    )
    return {"centroids": cent.astype(np.float32), "category_accuracy": acc.astype(np.float32)}


def _fit(
    learner: str, setting: float, x: np.ndarray, y: np.ndarray, categories: Sequence[str] | None
) -> dict[str, np.ndarray]:
    if learner == "linear":
        w, b = fit_linear(x, y, setting)
        return {"weight": w, "bias": b}
    if learner == "mf":
        w, b = fit_mf(x, y, int(setting))
        return {"weight": w, "bias": b}
    if learner == "centroid":
        assert categories is not None
        return fit_centroids(x, y, categories)
    return {"reference": x.astype(np.float32), "labels": y.astype(np.float32), "mean": np.nanmean(y, axis=0)}


def _raw(learner: str, setting: float, arrays: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    if learner == "knn":
        return knn_proba(arrays["reference"], arrays["labels"], arrays["mean"], x, int(setting), KNN_PRIOR)
    if learner == "centroid":
        return centroid_proba(arrays["centroids"], arrays["category_accuracy"], x, setting)
    return sigmoid(x @ arrays["weight"].T + arrays["bias"])


def routing_value(quality: np.ndarray, cost: np.ndarray, y: np.ndarray) -> float:
    """How much of the gap from the cheapest model to the most accurate one the router closes, on
    average over the money between their mean costs (0: no better than the cheapest; 1: the best
    model's accuracy at the cheapest one's cost): APGR with money in place of the strong share.
    NaN where the most accurate model is also the cheapest."""
    right = np.nan_to_num(y, nan=0.0)
    c = np.broadcast_to(np.asarray(cost, dtype=np.float64), right.shape)
    acc, mean_cost = right.mean(axis=0), c.mean(axis=0)
    best, cheap = int(np.lexsort((mean_cost, -acc))[0]), int(np.argmin(mean_cost))
    lo, hi, a_lo, a_hi = mean_cost[cheap], mean_cost[best], acc[cheap], acc[best]
    if hi <= lo or a_hi <= a_lo:
        return float("nan")
    pts = [outcome(quality, c, "utility", float(k), best, y) for k in knob_grid(quality, c, "utility", points=120)]
    # closed by the cheapest model (0, 0) and the most accurate one (1, 1), as RouteLLM's APGR is;
    # the best reached at or under each cost, mixtures of neighbouring settings between points
    xs = np.array([0.0, *((p.mean_cost - lo) / (hi - lo) for p in pts), 1.0])
    ys = np.array([0.0, *((p.accuracy - a_lo) / (a_hi - a_lo) for p in pts), 1.0])
    order = np.argsort(xs, kind="stable")
    xs, ys = np.clip(xs[order], 0, 1), np.maximum.accumulate(ys[order])
    return float(np.trapezoid(ys, xs))


def platt(raw: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per model, a and b of sigmoid(a * logit(raw) + b), by logistic regression on the held-back rows."""
    from sklearn.linear_model import LogisticRegression

    scale, shift = np.ones(y.shape[1]), np.zeros(y.shape[1])
    for j in range(y.shape[1]):
        known = ~np.isnan(y[:, j])
        t = y[known, j] > 0.5
        if t.all() or not t.any():
            continue
        model = LogisticRegression(C=100.0).fit(logit(raw[known, j])[:, None], t)
        scale[j], shift[j] = model.coef_[0, 0], model.intercept_[0]
    return scale, shift


def settings(only: Sequence[str] | None = None, categories: bool = False) -> list[tuple[str, float]]:
    grid = [
        *(("linear", c) for c in LINEAR_C),
        *(("mf", float(r)) for r in MF_RANKS),
        *(("knn", float(k)) for k in KNN_K),
        *(("centroid", t) for t in CENTROID_T if categories),
    ]
    return [g for g in grid if only is None or g[0] in only]


def _candidate(
    learner: str, setting: str, p: np.ndarray, y: np.ndarray, cost: np.ndarray | None, accuracy: np.ndarray
) -> Candidate:
    value = routing_value(prune(p, cost, accuracy), cost, y) if cost is not None else float("nan")
    return Candidate(learner, setting, _log_loss(p, y), _mean_auroc(p, y), value)


def fit_quality(
    name: str,
    models: Sequence[str],
    x: np.ndarray,
    y: np.ndarray,
    ids: Sequence[str],
    learners: Sequence[str] | None = None,
    calibration_fraction: float = 0.2,
    *,
    categories: Sequence[str] | None = None,
    cost: np.ndarray | None = None,
) -> QualityFit:
    """``x``: dev embeddings; ``y``: (rows, models) 1/0/NaN; ``categories``: the rows' categories
    (the centroid learner needs two or more); ``cost``: the rows' expected cost per model (rows,
    models), from the policy's prices. The setting is chosen on a held-back share (salt
    ``quality-select``): by :func:`routing_value` where costs are given (what the router is for),
    else by the mean AUROC of P(right); then the head is refitted and Platt-calibrated on a second
    share."""
    select = held_back(ids, 0.25, salt="triage-quality-select")
    cats = list(categories) if categories is not None and len(set(categories)) > 1 else None
    fit_cats = [c for c, m in zip(cats, ~select, strict=True) if m] if cats is not None else None
    sel_cost = None if cost is None else np.broadcast_to(cost, y.shape)[select]
    train_acc = np.nan_to_num(y[~select], nan=0.0).mean(axis=0)
    tried = []
    for learner, setting in settings(learners, cats is not None):
        arrays = _fit(learner, setting, x[~select], y[~select], fit_cats)
        p = _raw(learner, setting, arrays, x[select])
        tried.append(_candidate(learner, f"{setting:g}", p, y[select], sel_cost, train_acc))

    def key(c: Candidate) -> float:  # NaN (a set where no learner can be scored) ranks last
        return float(np.nan_to_num(c.value if cost is not None else c.auroc, nan=-1.0))

    by_learner = {c.learner: c for c in sorted(tried, key=key)}
    lin = max((c for c in by_learner.values() if c.learner in ("linear", "mf")), key=key, default=None)
    if lin is not None and "knn" in by_learner:  # the blend of the best linear-shaped and the best knn
        near = by_learner["knn"]
        parts = [_fit(c.learner, float(c.setting), x[~select], y[~select], None) for c in (lin, near)]
        p = (
            _raw(lin.learner, float(lin.setting), parts[0], x[select])
            + _raw("knn", float(near.setting), parts[1], x[select])
        ) / 2
        tried.append(
            _candidate("blend", f"{lin.learner} {lin.setting} + knn {near.setting}", p, y[select], sel_cost, train_acc)
        )
    best = max(tried, key=key)
    calib = held_back(ids, calibration_fraction)
    calib_cats = [c for c, m in zip(cats, ~calib, strict=True) if m] if cats is not None else None
    k, temperature = 0, 0.0
    if best.learner == "blend":
        assert lin is not None
        k = int(float(by_learner["knn"].setting))
        arrays = {
            **_fit(lin.learner, float(lin.setting), x[~calib], y[~calib], None),
            **_fit("knn", k, x[~calib], y[~calib], None),
        }
    else:
        k = int(float(best.setting)) if best.learner == "knn" else 0
        temperature = float(best.setting) if best.learner == "centroid" else 0.0
        arrays = _fit(best.learner, float(best.setting), x[~calib], y[~calib], calib_cats)
    kind: Kind
    match best.learner:
        case "blend" | "knn" | "centroid":
            kind = best.learner
        case _:
            kind = "linear"
    head = QualityHead(
        name,
        tuple(models),
        kind,
        arrays,
        np.ones(len(models), np.float32),
        np.zeros(len(models), np.float32),
        k,
        KNN_PRIOR if k else 0.0,
        temperature,
    )
    scale, shift = platt(head.raw(x[calib]), y[calib])
    meta = {
        "learner": best.learner,
        "setting": best.setting,
        "fit_rows": int((~calib).sum()),
        "dev_accuracy": [float(v) for v in np.nan_to_num(y, nan=0.0).mean(axis=0)],  # no answer: wrong
        "selected_by": "routing value" if cost is not None else "AUROC",
        "calibration_rows": int(calib.sum()),
        "tried": [{k: (None if isinstance(v, float) and v != v else v) for k, v in c.__dict__.items()} for c in tried],
    }
    head = QualityHead(
        name,
        tuple(models),
        kind,
        arrays,
        scale.astype(np.float32),
        shift.astype(np.float32),
        k,
        head.prior,
        temperature,
        meta,
    )
    return QualityFit(head, tried)


def quality_ece(p: np.ndarray, y: np.ndarray) -> float:
    """ECE of P(right) over every (row, model) cell with a label."""
    known = ~np.isnan(y)
    return ece(p[known], y[known] > 0.5)
