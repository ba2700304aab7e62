"""The memory of escalations (issue 56, item 3), measured where recorded answers allow: "past" is the
dev rows, each with the top model's recorded answer (what a store of escalations and shadow checks
would hold) and, as shadow checks would record them, the other models' answers; the test rows ask.

- **As the gate's prior** (:func:`memory_prior`): for each question, its nearest past questions
  (MiniLM's embedding, cosine) and how often each model agreed with the top's answer there, no gold
  read: the model's prior in the question's category, scaled by its agreement with the top among
  the neighbours over its agreement in the category (shrunk towards the category's). The pool's
  decision runs on it as on any prior (``python -m benchmarks pool --prior memory``).
- **As answers** (:func:`reuse`): where the nearest past question is the same question (cosine over
  a threshold and the same options), the top's answer there, taken as is.
- **As examples in a cheap model's prompt** (the retrieval-augmented few-shot the issue names): not
  measurable on recorded answers; it needs the cheap models to answer again with the examples.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.pool_data import Recorded
from eval.pool_fit import FOLDS, folds

NEIGHBOURS = 20
SHRINK = 5.0  # neighbours' worth of the category's agreement rate
THRESHOLDS = (0.99, 0.97, 0.95, 0.9)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def nearest(
    x_from: np.ndarray, x_to: np.ndarray, k: int, barred: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """For each row of ``x_to``, its ``k`` nearest rows of ``x_from`` (cosine): (indices, similarities);
    ``barred`` (to, from): pairs never matched."""
    a, b = _unit(x_from), _unit(x_to)
    idx, sim = [], []
    for lo in range(0, len(b), 1024):
        s = b[lo : lo + 1024] @ a.T
        if barred is not None:
            s = np.where(barred[lo : lo + 1024], -np.inf, s)
        top = np.argpartition(-s, k, axis=1)[:, :k]
        ts = np.take_along_axis(s, top, axis=1)
        order = np.argsort(-ts, axis=1)
        idx.append(np.take_along_axis(top, order, axis=1))
        sim.append(np.take_along_axis(ts, order, axis=1))
    return np.concatenate(idx), np.concatenate(sim)


def _scaled(
    agree: np.ndarray,
    cats_from: list[str],
    idx: np.ndarray,
    sim: np.ndarray,
    cats_to: list[str],
    prior: np.ndarray,
    top: int,
) -> np.ndarray:
    overall = agree.mean(axis=0)
    c = np.asarray(cats_from)
    per = {
        cat: (agree[c == cat].sum(axis=0) + SHRINK * overall) / ((c == cat).sum() + SHRINK) for cat in set(cats_from)
    }
    base = np.array([per.get(cat, overall) for cat in cats_to])  # (to, models)
    s = np.clip(sim, 0.0, None)[:, :, None]
    local = ((s * agree[idx]).sum(axis=1) + SHRINK * base) / (s.sum(axis=1) + SHRINK)
    out = np.clip(prior * local / np.maximum(base, 1e-6), 0.01, 0.99)
    out[:, top] = prior[:, top]
    return out


def memory_prior(
    dev: Recorded, test: Recorded, x: tuple[np.ndarray, np.ndarray], top: int, prior: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """(dev rows' priors, each from the past rows of the other folds; test rows' from every dev row):
    ``prior`` (the category priors) scaled by the neighbours' agreement with the ``top``'s answer."""
    agree = ((dev.answers == dev.answers[:, top : top + 1]) & (dev.answers >= 0)).astype(np.float64)
    cats = dev.labels.categories
    fold = folds(dev.labels.ids, FOLDS)
    idx, sim = nearest(x[0], x[0], NEIGHBOURS, barred=fold[:, None] == fold[None, :])
    p_dev = np.zeros(prior[0].shape)
    for f in range(FOLDS):  # the category's rates from the other folds too
        inside = fold != f
        rows = ~inside
        remap = np.cumsum(inside) - 1  # neighbours are all in other folds: index them among those
        p_dev[rows] = _scaled(
            agree[inside],
            [c for c, keep in zip(cats, inside, strict=True) if keep],
            remap[idx[rows]],
            sim[rows],
            [c for c, keep in zip(cats, rows, strict=True) if keep],
            prior[0][rows],
            top,
        )
    idx_t, sim_t = nearest(x[0], x[1], NEIGHBOURS)
    return p_dev, _scaled(agree, cats, idx_t, sim_t, test.labels.categories, prior[1], top)


def reuse(dev: Recorded, test: Recorded, x: tuple[np.ndarray, np.ndarray], top: int) -> list[dict[str, Any]]:
    """Per threshold: the test rows whose nearest dev row is that close and has the same options, and
    how often the top's answer there is right here, against the top's own answer here."""
    idx, sim = nearest(x[0], x[1], 1)
    idx, sim = idx[:, 0], sim[:, 0]
    same = np.array([sorted(test.options[i]) == sorted(dev.options[j]) for i, j in enumerate(idx)])
    past = dev.answers[idx, top]
    text = [dev.options[j][a] if a >= 0 else None for j, a in zip(idx, past, strict=True)]
    reused = np.array([t is not None and t == test.options[i][test.gold[i]] for i, t in enumerate(text)])
    own = test.answers[:, top] == test.gold
    out = []
    for th in THRESHOLDS:
        m = same & (sim >= th)
        out.append(
            {
                "threshold": th,
                "rows": int(m.sum()),
                "share": float(m.mean()),
                "reused_right": float(reused[m].mean()) if m.any() else None,
                "top_right_there": float(own[m].mean()) if m.any() else None,
            }
        )
    return out
