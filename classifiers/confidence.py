"""A learned gate: P(this tier's answer is right), from what the cascade already has.

A tier's top probability is a poor signal where the model is weak: a 1.5B model is as sure of
its wrong MMLU-Pro answers as of its right PIQA ones. A confidence model reads, for one tier's
answer to one question, the tier's probabilities (top, margin between the first two, entropy,
the number of options), the question type, whether a passage came with it, whether the tier
asked before agreed and how sure that one was, and optionally the question's embedding (which
names the kind of question: the sets where the tier is good). A logistic regression over these,
followed by a Platt calibration fitted on out-of-fold predictions, gives the probability the
cascade compares with the tier's threshold (``gate: learned`` on a tier; docs/cascade.md).

Serving needs only numpy; fitting lives in :mod:`classifiers.confidence_training`. Saved as
``confidence-<tier>.npz`` (arrays) + ``.json`` (the rest); nothing is unpickled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gateway.errors import NotReady

FORMAT = 1
FEATURES_VERSION = 1
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


@dataclass(frozen=True)
class Signals:
    """One tier's answer to one question, as the confidence model reads it."""

    qtype: str  # choice | yes_no | score
    probabilities: Sequence[float]  # per option, after the tier's temperature
    context: bool = False
    question_chars: int = 0
    previous_top: float | None = None  # the tier asked before: its top probability (None: no tier before)
    previous_agrees: bool = False  # ... and whether it gave the same answer
    embedding: np.ndarray | None = field(default=None, compare=False)


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


def features(s: Signals, uses_embedding: bool) -> np.ndarray:
    x = scalars(s)
    if not uses_embedding:
        return x
    if s.embedding is None:
        raise ValueError("this confidence model reads the question's embedding, and none was given")
    return np.concatenate([x, np.asarray(s.embedding, dtype=np.float64).ravel()])


@dataclass(frozen=True, eq=False)
class ConfidenceModel:
    tier: str
    weight: np.ndarray  # over the standardised features
    bias: float
    mean: np.ndarray  # per feature, for standardising
    scale: np.ndarray
    uses_embedding: bool
    platt: tuple[float, float] = (1.0, 0.0)  # a * z + b on the regression's log-odds
    meta: dict[str, Any] = field(default_factory=dict)

    def log_odds(self, x: np.ndarray) -> np.ndarray:
        z = ((x - self.mean) / self.scale) @ self.weight + self.bias
        return self.platt[0] * z + self.platt[1]

    def p_right(self, s: Signals) -> float:
        z = float(self.log_odds(features(s, self.uses_embedding)[None, :])[0])
        return 1.0 / (1.0 + math.exp(-min(max(z, -40.0), 40.0)))

    def save(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        name = confidence_name(self.tier)
        np.savez(directory / f"{name}.npz", weight=self.weight, mean=self.mean, scale=self.scale)
        doc = {
            "format": FORMAT,
            "features_version": FEATURES_VERSION,
            "tier": self.tier,
            "bias": self.bias,
            "uses_embedding": self.uses_embedding,
            "platt": list(self.platt),
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
        return cls(
            doc["tier"],
            weight,
            float(doc["bias"]),
            mean,
            scale,
            bool(doc["uses_embedding"]),
            (float(doc["platt"][0]), float(doc["platt"][1])),
            doc.get("meta", {}),
        )
