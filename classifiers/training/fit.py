"""Fit a head: logistic regression on embeddings, then a temperature on held-back rows.

The held-back rows are chosen by a hash of each row's id (stable across runs and machines,
never a random generator), so calibration never sees the rows the weights were fitted on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from classifiers.calibration import ece, fit_temperature
from classifiers.heads import LinearHead


def held_back(ids: Sequence[str], fraction: float, salt: str = "triage-calibration") -> np.ndarray:
    """A boolean mask of the rows kept out of fitting, by SHA-256 of salt and id."""
    cut = int(fraction * 2**32)
    return np.array(
        [int.from_bytes(hashlib.sha256(f"{salt}:{i}".encode()).digest()[:4], "big") < cut for i in ids], dtype=bool
    )


@dataclass(frozen=True)
class FitReport:
    n_fit: int
    n_calibration: int
    calibration_accuracy: float
    ece_before: float
    ece_after: float
    temperature: float


def fit_head(
    name: str,
    x: np.ndarray,
    labels: Sequence[str],
    ids: Sequence[str],
    *,
    c: float = 4.0,
    calibration_fraction: float = 0.2,
    balanced: bool = False,
    classes: Sequence[str] | None = None,
    synthetic: Sequence[bool] | None = None,
) -> tuple[LinearHead, FitReport]:
    """A logistic-regression head, its temperature fitted on a held-back share of the rows.
    ``synthetic`` rows (generated, not drawn from the data) are only ever fitted on: a temperature
    is for the prompts a head will meet, which generated ones only imitate."""
    from sklearn.linear_model import LogisticRegression

    classes = tuple(sorted(set(labels)) if classes is None else classes)
    index = {c_: i for i, c_ in enumerate(classes)}
    y = np.array([index[label] for label in labels])
    calib = held_back(ids, calibration_fraction)
    if synthetic is not None:
        calib &= ~np.asarray(synthetic, dtype=bool)
    if calib.all() or not calib.any():
        calib = np.arange(len(y)) % 5 == 0  # tiny sets: every fifth row
    model = LogisticRegression(C=c, max_iter=2000, class_weight="balanced" if balanced else None)
    model.fit(x[~calib], y[~calib])
    weight, bias = _full_rank(model, len(classes))
    head = LinearHead(name, classes, weight, bias, 1.0)
    logits = head.logits(x[calib])
    t = fit_temperature(logits, y[calib])
    before = head.proba(x[calib], 1.0)
    after = head.proba(x[calib], t)
    correct = before.argmax(1) == y[calib]
    report = FitReport(
        int((~calib).sum()),
        int(calib.sum()),
        float(correct.mean()),
        ece(before.max(1), correct),
        ece(after.max(1), correct),
        t,
    )
    meta = {
        "fit_rows": report.n_fit,
        "calibration_rows": report.n_calibration,
        "calibration_accuracy": report.calibration_accuracy,
        "ece_before": report.ece_before,
        "ece_after": report.ece_after,
        "c": c,
    }
    return LinearHead(name, classes, weight, bias, t, meta), report


def _full_rank(model: object, k: int) -> tuple[np.ndarray, np.ndarray]:
    """One weight row per class, in ``classes`` order. scikit-learn keeps one row for a model
    that saw two classes, and none for classes absent from the fit rows (never predicted)."""
    coef = np.asarray(model.coef_, dtype=np.float32)  # type: ignore[attr-defined]
    intercept = np.asarray(model.intercept_, dtype=np.float32)  # type: ignore[attr-defined]
    seen = [int(c) for c in model.classes_]  # type: ignore[attr-defined]
    if len(seen) == 2 and coef.shape[0] == 1:
        coef = np.vstack([-coef[0] / 2, coef[0] / 2])
        intercept = np.array([-intercept[0] / 2, intercept[0] / 2], dtype=np.float32)
    weight = np.zeros((k, coef.shape[1]), dtype=np.float32)
    bias = np.full(k, -1e4, dtype=np.float32)
    for row, cls in enumerate(seen):
        weight[cls] = coef[row]
        bias[cls] = intercept[row]
    return weight, bias
