"""A learned gate: P(this tier's answer is right), from what the cascade already has.

A tier's top probability is a poor signal where the model is weak: a 1.5B model is as sure of
its wrong MMLU-Pro answers as of its right PIQA ones. A confidence model reads, for one tier's
answer to one question, the tier's probabilities (top, margin between the first two, entropy,
the number of options), the question type, whether a passage came with it, whether the tier
asked before agreed and how sure that one was, and, in the ``neighbours`` variant, how often the
tier was right on the fitting rows whose questions are nearest this one's (cosine of the
encoder's embeddings; the share of the ``k`` nearest, shrunk towards the tier's mean by ``prior``
pseudo-rows, and the nearest one's similarity): that names the kind of question, the sets where
the tier is good (the ``embedding`` variant, the raw vector as features, is tried too). A
logistic regression over these, followed by a Platt calibration fitted on out-of-fold
predictions (one per question type that has enough fitting rows, over one for all), gives the
probability the cascade compares with the tier's threshold (``gate: learned`` on a tier;
docs/cascade.md).

Beside it, where the fitting rows had embeddings, the model keeps whether escalating was right on
each of them (the last tier's answer): :meth:`ConfidenceModel.p_after` is that share among the
``k`` nearest, the same statistic, so a gate with an ``escalation_margin`` keeps an answer only
when it is about as likely right as the answer escalating would get on such questions (a tier
that is right 60% of the time on BoolQ is sure enough for a 0.52 threshold, but the tier after it
is right 74% there).

Serving needs only numpy; fitting lives in :mod:`classifiers.training.confidence_training`. Saved as
``confidence-<tier>.npz`` (arrays) + ``.json`` (the rest); nothing is unpickled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from policies.cascade import Signals
from policies.errors import NotReady

FORMAT = 2
FEATURES_VERSION = 2
Variant = Literal["scalars", "neighbours", "embedding"]
SCALARS = (
    "top",
    "logit_top",
    "margin",
    "entropy",
    "log_options",
    "choice",
    "yes_no",
    "score",
    "top_x_yes_no",
    "context",
    "question_chars",
    "has_previous",
    "previous_agrees",
    "previous_top",
)


def confidence_name(tier: str) -> str:
    """The artifact name of a tier's confidence model."""
    return f"confidence-{tier}"


def scalars(s: Signals) -> np.ndarray:
    p = np.sort(np.asarray(s.probabilities, dtype=np.float64))[::-1]
    top = float(p[0])
    second = float(p[1]) if len(p) > 1 else 0.0
    n = len(p)
    q = np.clip(p, 1e-12, 1.0)
    entropy = float(-(q * np.log(q)).sum() / math.log(n)) if n > 1 else 0.0
    t = min(max(top, 1e-4), 1 - 1e-4)
    has_prev = s.previous_top is not None
    return np.array(
        [
            top,
            math.log(t / (1 - t)),
            top - second,
            entropy,
            math.log(n),
            s.qtype == "choice",
            s.qtype == "yes_no",
            s.qtype == "score",
            top * (s.qtype == "yes_no"),
            s.context,
            math.log1p(s.question_chars) / 10.0,
            has_prev,
            has_prev and s.previous_agrees,
            s.previous_top if has_prev else 0.0,
        ],
        dtype=np.float64,
    )


def _logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(q / (1 - q))


def neighbour_stats(sims: np.ndarray, right: np.ndarray, k: int, prior: float, base: float) -> np.ndarray:
    """Per query row of ``sims`` (cosines to the reference rows, ``-inf`` for rows to leave out):
    the shrunk share right among the ``k`` nearest, its log-odds, and the nearest cosine."""
    k = max(1, min(k, sims.shape[1] - 1 if sims.shape[1] > 1 else 1))
    idx = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    near = np.take_along_axis(sims, idx, axis=1)
    hits = np.where(np.isfinite(near), right[idx], 0.0).sum(axis=1)
    counted = np.isfinite(near).sum(axis=1)
    acc = (hits + prior * base) / (counted + prior)
    top = np.where(np.isfinite(near), near, -1.0).max(axis=1)
    return np.column_stack([acc, _logit(acc), top])


@dataclass(frozen=True, eq=False)
class ConfidenceModel:
    tier: str
    weight: np.ndarray  # over the standardised features
    bias: float
    mean: np.ndarray  # per feature, for standardising
    scale: np.ndarray
    variant: Variant
    platt: tuple[float, float] = (1.0, 0.0)  # a * z + b on the regression's log-odds
    meta: dict[str, Any] = field(default_factory=dict)
    reference: np.ndarray | None = None  # (n, d) unit embeddings of the fitting rows (neighbours, or after)
    right: np.ndarray | None = None  # neighbours: (n,) 1 where the tier was right on that row
    k: int = 32
    prior: float = 8.0
    after: np.ndarray | None = None  # (n,) 1 where escalating (the last tier) was right on that row
    platt_by_type: dict[str, tuple[float, float]] = field(default_factory=dict)  # over ``platt``, per type

    @property
    def needs_embedding(self) -> bool:
        """P(right) cannot be read without the question's embedding."""
        return self.variant != "scalars"

    @property
    def uses_embedding(self) -> bool:
        """Something reads the embedding: P(right), or P(escalating gets it right)."""
        return self.needs_embedding or self.after is not None

    def p_after(self, s: Signals) -> float | None:
        """P(escalating gets this question right): the last tier's shrunk share right among the
        ``k`` fitting questions nearest this one; None without an embedding or that record."""
        if self.after is None or self.reference is None or s.embedding is None:
            return None
        e = np.asarray(s.embedding, dtype=np.float64).ravel()
        sims = (self.reference @ e)[None, :]
        return float(neighbour_stats(sims, self.after, self.k, self.prior, float(self.after.mean()))[0, 0])

    def features(self, s: Signals) -> np.ndarray:
        x = scalars(s)
        if self.variant == "scalars":
            return x
        if s.embedding is None:
            raise ValueError("this confidence model reads the question's embedding, and none was given")
        e = np.asarray(s.embedding, dtype=np.float64).ravel()
        if self.variant == "embedding":
            return np.concatenate([x, e])
        assert self.reference is not None and self.right is not None
        sims = (self.reference @ e)[None, :]
        base = float(self.right.mean())
        return np.concatenate([x, neighbour_stats(sims, self.right, self.k, self.prior, base)[0]])

    def log_odds(self, x: np.ndarray, qtype: str | None = None) -> np.ndarray:
        z = ((x - self.mean) / self.scale) @ self.weight + self.bias
        a, b = self.platt_by_type.get(qtype or "", self.platt)
        return a * z + b

    def p_right(self, s: Signals) -> float:
        z = float(self.log_odds(self.features(s)[None, :], s.qtype)[0])
        return 1.0 / (1.0 + math.exp(-min(max(z, -40.0), 40.0)))

    def save(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        name = confidence_name(self.tier)
        arrays = {"weight": self.weight, "mean": self.mean, "scale": self.scale}
        if self.reference is not None:
            arrays["reference"] = self.reference.astype(np.float32)
        for key, values in (("right", self.right), ("after", self.after)):
            if values is not None:
                arrays[key] = values.astype(np.float32)
        np.savez(directory / f"{name}.npz", **arrays)  # type: ignore[arg-type]
        doc = {
            "format": FORMAT,
            "features_version": FEATURES_VERSION,
            "tier": self.tier,
            "bias": self.bias,
            "variant": self.variant,
            "platt": list(self.platt),
            "platt_by_type": {k: list(v) for k, v in self.platt_by_type.items()},
            "k": self.k,
            "prior": self.prior,
            "scalars": list(SCALARS),
            "meta": self.meta,
        }
        path = directory / f"{name}.json"
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: Path, tier: str, build_hint: str = "triage train --policy POLICY") -> ConfidenceModel:
        name = confidence_name(tier)
        meta_path, arrays_path = directory / f"{name}.json", directory / f"{name}.npz"
        if not meta_path.is_file() or not arrays_path.is_file():
            raise NotReady(f"tier '{tier}' has `gate: learned` but {meta_path} is missing: run `{build_hint}`")
        doc = json.loads(meta_path.read_text())
        if doc.get("format") != FORMAT or doc.get("features_version") != FEATURES_VERSION:
            raise NotReady(f"{meta_path} was written by another version of triage: run `{build_hint}`")
        with np.load(arrays_path, allow_pickle=False) as z:
            weight, mean, scale = z["weight"], z["mean"], z["scale"]
            reference = z["reference"].astype(np.float64) if "reference" in z else None
            right = z["right"].astype(np.float64) if "right" in z else None
            after = z["after"].astype(np.float64) if "after" in z else None
        return cls(
            doc["tier"],
            weight,
            float(doc["bias"]),
            mean,
            scale,
            doc["variant"],
            (float(doc["platt"][0]), float(doc["platt"][1])),
            doc.get("meta", {}),
            reference,
            right,
            int(doc.get("k", 32)),
            float(doc.get("prior", 8.0)),
            after,
            {k: (float(v[0]), float(v[1])) for k, v in doc.get("platt_by_type", {}).items()},
        )
