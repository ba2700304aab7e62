"""Quality heads: per candidate model, the probability that it answers a prompt right, read from
the prompt's embedding. Serving needs only numpy; training is :mod:`classifiers.training.quality_training`.

Two kinds, chosen by measurement on dev rows (docs/router.md):

- ``linear``: a weight row and a bias per model on the embedding (per-model logistic regression,
  or the shared low-rank fit of matrix factorisation, which is the same shape once multiplied out);
- ``knn``: the labels of the ``k`` most similar dev prompts (cosine), shrunk towards the model's
  mean accuracy by ``prior`` pseudo-rows (RouterBench's KNN router);
- ``blend``: the mean of the two (the best linear and the best knn setting);
- ``centroid``: a soft category table: the prompt's closeness to each category's mean dev
  embedding (softmax of cosines over ``temperature``) weighs each model's accuracy in that
  category on the dev rows (shrunk towards its overall accuracy). It needs the labels file's
  categories (MMLU-Pro's 14, MMLU's 57 subjects) and wins where many candidates differ by subject.

Either is followed by a per-model Platt calibration (``a * logit(p) + b``), fitted on held-back dev
rows. Saved as ``<name>.npz`` (arrays) + ``<name>.json`` (the rest); nothing is unpickled.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from policies.errors import NotReady

FORMAT = 1
Kind = Literal["linear", "knn", "blend", "centroid"]
_EPS = 1e-4


def quality_head_name(virtual_model: str) -> str:
    """The artifact name of a routed virtual model's quality head."""
    return f"quality-{virtual_model}"


def probe_head_name(virtual_model: str) -> str:
    """The artifact name of a routed model's second head, on MiniLM's embedding and its probe's reading."""
    return f"quality-{virtual_model}-probe"


def joint_features(embedding: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """What the probe's head reads: the encoder's embedding and the probe's reading, each at length
    1 and scaled by 1/sqrt(2), side by side (a unit vector again, so the nearest-neighbour and
    centroid learners weigh both halves alike). Rows of each, or one vector of each."""

    def unit(v: np.ndarray) -> np.ndarray:
        v = np.atleast_2d(np.asarray(v, dtype=np.float32))
        return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)

    out: np.ndarray = np.hstack([unit(embedding), unit(hidden)]) / np.float32(np.sqrt(2.0))
    return out


def read_rows(hidden: np.ndarray) -> np.ndarray:
    """Which rows of a probe's readings it read: one of zeros is a prompt it could not read (empty;
    ``reading: letters``, not lettered), where the served router does without the probe."""
    out: np.ndarray = np.linalg.norm(np.atleast_2d(hidden), axis=1) > 0
    return out


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _EPS, 1 - _EPS)
    return np.log(p / (1 - p))


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -40, 40)))


@dataclass(frozen=True, eq=False)
class QualityHead:
    name: str
    models: tuple[str, ...]
    kind: Kind
    arrays: dict[str, np.ndarray]  # linear: weight (M, d), bias (M,); knn: reference (n, d), labels (n, M), mean (M,)
    scale: np.ndarray  # (M,) Platt a
    shift: np.ndarray  # (M,) Platt b
    k: int = 0
    prior: float = 0.0
    temperature: float = 0.0  # centroid: of the softmax over cosines
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def dim(self) -> int:
        key = next(k for k in ("weight", "reference", "centroids") if k in self.arrays)
        return int(self.arrays[key].shape[1])

    @property
    def dev_accuracy(self) -> np.ndarray | None:
        """Each model's accuracy on the rows the head was fitted on (None for heads saved without it)."""
        acc = self.meta.get("dev_accuracy")
        return None if acc is None else np.asarray(acc, dtype=np.float64)

    @functools.cached_property
    def _label_masks(self) -> tuple[np.ndarray, np.ndarray]:
        """knn: the labels with NaN as 0, and where they are known: once, not per request."""
        labels = self.arrays["labels"]
        return np.nan_to_num(labels), (~np.isnan(labels)).astype(labels.dtype)

    def raw(self, x: np.ndarray) -> np.ndarray:
        """Uncalibrated P(right), (rows, models)."""
        x = np.atleast_2d(np.asarray(x, dtype=np.float32))
        a = self.arrays
        if self.kind == "centroid":
            return centroid_proba(a["centroids"], a["category_accuracy"], x, self.temperature)
        linear = sigmoid(x @ a["weight"].T + a["bias"]) if self.kind != "knn" else None
        near = None
        if self.kind != "linear":
            near = knn_proba(a["reference"], a["labels"], a["mean"], x, self.k, self.prior, masks=self._label_masks)
        if linear is not None and near is not None:
            return (linear + near) / 2
        out = linear if linear is not None else near
        assert out is not None
        return out

    def proba(self, x: np.ndarray) -> np.ndarray:
        """Calibrated P(right) per model, (rows, models)."""
        return sigmoid(self.scale * logit(self.raw(x)) + self.shift)

    def save(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(
            directory / f"{self.name}.npz",
            scale=self.scale,
            shift=self.shift,
            allow_pickle=True,  # numpy's default, named so that the arrays below are never read as it
            **{k: v.astype(np.float32) for k, v in self.arrays.items()},
        )
        doc = {
            "format": FORMAT,
            "name": self.name,
            "models": list(self.models),
            "kind": self.kind,
            "k": self.k,
            "prior": self.prior,
            "temperature": self.temperature,
            "meta": self.meta,
        }
        path = directory / f"{self.name}.json"
        path.write_text(json.dumps(doc, indent=2, sort_keys=True))
        return path

    @classmethod
    def load(cls, directory: Path, name: str, build_hint: str = "triage train --policy POLICY") -> QualityHead:
        doc_path, arr_path = directory / f"{name}.json", directory / f"{name}.npz"
        for path in (doc_path, arr_path):
            if not path.is_file():
                raise NotReady(f"quality head {path} is missing: build it with `{build_hint}`")
        doc = json.loads(doc_path.read_text())
        if doc.get("format") != FORMAT:
            raise NotReady(
                f"quality head {doc_path} has format {doc.get('format')}, expected {FORMAT}: "
                f"rebuild it with `{build_hint}`"
            )
        with np.load(arr_path, allow_pickle=False) as a:
            arrays = {k: a[k] for k in a.files if k not in ("scale", "shift")}
            scale, shift = a["scale"], a["shift"]
        return cls(
            doc["name"],
            tuple(doc["models"]),
            doc["kind"],
            arrays,
            scale,
            shift,
            int(doc["k"]),
            float(doc["prior"]),
            float(doc.get("temperature", 0.0)),
            doc.get("meta", {}),
        )


def knn_proba(
    reference: np.ndarray,
    labels: np.ndarray,
    mean: np.ndarray,
    x: np.ndarray,
    k: int,
    prior: float,
    exclude_self: bool = False,
    masks: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Mean label of the ``k`` nearest reference rows (embeddings are unit-length: dot = cosine),
    with ``prior`` pseudo-rows at each model's mean. NaN labels (no answer) are skipped.
    ``exclude_self``: ``x`` is ``reference`` (leave-one-out, for fitting)."""
    out = np.empty((len(x), labels.shape[1]))
    filled, known = masks if masks is not None else (np.nan_to_num(labels), (~np.isnan(labels)).astype(labels.dtype))
    for start in range(0, len(x), 512):
        sim = x[start : start + 512] @ reference.T
        if exclude_self:
            sim[np.arange(len(sim)), np.arange(start, start + len(sim))] = -np.inf
        near = np.argpartition(-sim, min(k, sim.shape[1] - 1), axis=1)[:, :k]
        hits = (filled[near] * known[near]).sum(axis=1)
        counts = known[near].sum(axis=1)
        out[start : start + 512] = (hits + prior * mean) / (counts + prior)
    return out


def centroid_proba(
    centroids: np.ndarray, category_accuracy: np.ndarray, x: np.ndarray, temperature: float
) -> np.ndarray:
    """Each model's dev accuracy per category, weighted by the softmax of the prompt's cosine to
    each category's centroid (unit vectors: dot = cosine)."""
    z = (x @ centroids.T) / temperature
    w = np.exp(z - z.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return np.clip(w @ category_accuracy, _EPS, 1 - _EPS)
