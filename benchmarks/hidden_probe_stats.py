"""The statistics of the hidden-state probe's benchmark (``benchmarks/hidden_probe.py``), also used by
``benchmarks/consistency.py`` and ``benchmarks/delegation.py``: AUROC, calibration error, the probe's fit,
paired bootstrap intervals."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

CS = (0.01, 0.1, 1.0)
FOLDS = 5
BOOTSTRAP = 1000


@dataclass
class Outcome:
    id: str
    source: str
    split: str
    qtype: str
    probs: list[float]
    right: bool
    seconds: float  # the lettered scoring with embedding mode on (the hidden state read)
    hidden: np.ndarray
    check: dict[str, Any] | None = None  # the pass with embedding mode off, on every CHECK_EVERY-th row

    def to_json(self) -> dict[str, Any]:
        doc = {k: v for k, v in self.__dict__.items() if k != "hidden"}
        doc["hidden"] = base64.b64encode(self.hidden.astype(np.float32).tobytes()).decode()
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Outcome:
        hidden = np.frombuffer(base64.b64decode(doc.pop("hidden")), dtype=np.float32).copy()
        return cls(**doc, hidden=hidden)


def _auroc(score: np.ndarray, right: np.ndarray) -> float | None:
    from sklearn.metrics import roc_auc_score

    if right.min() == right.max():
        return None
    return float(roc_auc_score(right, score))


def _ece(p: np.ndarray, right: np.ndarray, bins: int = 10) -> float:
    edges = np.linspace(0, 1, bins + 1)
    idx = np.clip(np.digitize(p, edges[1:-1], right=True), 0, bins - 1)
    return float(
        sum(
            (idx == b).mean() * abs(p[idx == b].mean() - right[idx == b].mean())
            for b in range(bins)
            if (idx == b).any()
        )
    )


def _margin(probs: list[float]) -> float:
    top = sorted(probs, reverse=True)
    return top[0] - top[1]


def _features(outcomes: list[Outcome], with_conf: bool) -> np.ndarray:
    x = np.stack([o.hidden for o in outcomes]).astype(np.float64)
    if with_conf:
        extra = np.array([[max(o.probs), _margin(o.probs)] for o in outcomes])
        x = np.hstack([x, extra])
    return x


def fit_probe(x_dev: np.ndarray, y_dev: np.ndarray) -> tuple[Any, float, dict[str, float]]:
    """Standardised logistic regression; C by 5-fold CV AUROC on the dev rows; refit on them all."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def model(c: float) -> Any:
        return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=5000))

    folds = StratifiedKFold(FOLDS, shuffle=True, random_state=0)
    cv = {str(c): float(cross_val_score(model(c), x_dev, y_dev, cv=folds, scoring="roc_auc").mean()) for c in CS}
    best = max(CS, key=lambda c: cv[str(c)])
    return model(best).fit(x_dev, y_dev), best, cv


def _bootstrap(scores: dict[str, np.ndarray], right: np.ndarray, base: str) -> dict[str, dict[str, float]]:
    """95% percentile intervals of each pooled AUROC and of its difference from ``base``'s."""
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    draws: dict[str, list[float]] = {k: [] for k in scores}
    diffs: dict[str, list[float]] = {k: [] for k in scores if k != base}
    n = len(right)
    for _ in range(BOOTSTRAP):
        idx = rng.integers(0, n, n)
        y = right[idx]
        if y.min() == y.max():
            continue
        got = {k: float(roc_auc_score(y, s[idx])) for k, s in scores.items()}
        for k, v in got.items():
            draws[k].append(v)
            if k != base:
                diffs[k].append(v - got[base])
    out = {k: {"lo": float(np.percentile(v, 2.5)), "hi": float(np.percentile(v, 97.5))} for k, v in draws.items()}
    for k, d in diffs.items():
        out[k]["diff_vs_" + base] = float(np.mean(d))
        out[k]["diff_lo"] = float(np.percentile(d, 2.5))
        out[k]["diff_hi"] = float(np.percentile(d, 97.5))
    return out
