"""The out-of-distribution guard: which prompts the heads' answers must not be trusted for.

- **unfamiliar**: a prompt in another language than English (:mod:`classifiers.language`: the
  encoder and the heads know English only), or one whose word pieces are foreign to the
  encoder's English vocabulary (continuation pieces, [UNK], non-ASCII) more often than
  ``FOREIGN_QUANTILE`` of held-out training prompts (gibberish, languages CLD2 was not sure of),
  or whose highest cosine similarity to a sample of the training prompts is under their
  ``SIMILARITY_QUANTILE``. Both
  cuts are fitted by ``triage train`` on held-out training prompts and kept in
  ``reference.json``. Measured on the probes, the language and vocabulary checks do nearly all
  the catching: ordinary prompts outside the training sets are as far from them as gibberish
  is, so the similarity cut is kept for the extreme only.
- **addressed to the router** (the ``injection`` head): P(router) of the prompt, or of any of its
  sentences, at or above the head's fitted cut. It reads them at an earlier layer of the same
  forward (``ExportSettings.guard_layer``, 3 of 6): heads trained on 3- and 4-layer exports caught
  as many router-aimed probes as on 6 layers and flagged none of the benign questions about
  models and routing that the 6-layer one flagged (10 of 75). Its positives are generated
  (:mod:`classifiers.injections`); it is measured on probes written apart from them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from classifiers.heads import LinearHead
from classifiers.language import UNKNOWN, foreign_language
from policies.errors import NotReady
from policies.semantic import ROUTER, Prediction

if TYPE_CHECKING:  # the encoder (ONNX Runtime) stays out of the routing rules' imports
    from classifiers.encoder import Reading

REFERENCE = "reference"
SIMILARITY_QUANTILE = 0.001  # of held-out training prompts flagged as far from everything
FOREIGN_QUANTILE = 0.995  # ... passed by the vocabulary check
INJECTION_QUANTILE = 0.995  # ... passed by the injection head (its cut is at least 0.5)


@dataclass(frozen=True)
class Familiarity:
    """How close a prompt is to what the heads were trained on."""

    similarity: float  # highest cosine similarity to the reference sample
    threshold: float
    foreign: float  # share of foreign word pieces
    foreign_threshold: float
    language: str = UNKNOWN  # "en", another language's code, or "un"

    @property
    def readable(self) -> bool:
        """English in the encoder's word pieces: the language and the vocabulary checks pass."""
        return self.foreign <= self.foreign_threshold and not foreign_language(self.language)

    @property
    def in_distribution(self) -> bool:
        return self.readable and self.similarity >= self.threshold


class Reference:
    """A sample of training embeddings and the cuts under (over) which a prompt is unfamiliar."""

    def __init__(self, vectors: np.ndarray, threshold: float, foreign_threshold: float, layers: int = 6) -> None:
        self.vectors = vectors.astype(np.float32)
        self.threshold = threshold
        self.foreign_threshold = foreign_threshold
        self.layers = layers  # of the encoder the heads were trained on

    def similarity(self, x: np.ndarray) -> np.ndarray:
        return (np.atleast_2d(x) @ self.vectors.T).max(axis=1)

    def familiarity(self, readings: list[Reading]) -> list[Familiarity]:
        if not readings:
            return []
        sims = self.similarity(np.stack([r.vector for r in readings]))
        return [
            Familiarity(float(s), self.threshold, r.foreign, self.foreign_threshold, r.language)
            for s, r in zip(sims, readings, strict=True)
        ]

    def save(self, directory: Path, meta: dict[str, object]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / f"{REFERENCE}.npz", vectors=self.vectors.astype(np.float16))
        doc = {"threshold": self.threshold, "foreign_threshold": self.foreign_threshold, "layers": self.layers, **meta}
        (directory / f"{REFERENCE}.json").write_text(json.dumps(doc, indent=2))

    @classmethod
    def load(cls, directory: Path, hint: str) -> Reference:
        doc_path, arr = directory / f"{REFERENCE}.json", directory / f"{REFERENCE}.npz"
        for path in (doc_path, arr):
            if not path.is_file():
                raise NotReady(f"classifier artifact {path} is missing: build it with `{hint}`")
        doc = json.loads(doc_path.read_text())
        if "foreign_threshold" not in doc:
            raise NotReady(f"classifier artifact {doc_path} predates the vocabulary check: rebuild it with `{hint}`")
        with np.load(arr, allow_pickle=False) as a:
            vectors = a["vectors"].astype(np.float32)
        return cls(vectors, float(doc["threshold"]), float(doc["foreign_threshold"]), int(doc.get("layers", 6)))


def guard_view(reading: Reading) -> np.ndarray:
    """What the injection head reads: the whole prompt, then each sentence, at the guard layer."""
    whole = reading.shallow if reading.shallow is not None else reading.vector
    return np.vstack([whole[None, :], reading.segments])


def router_probability(head: LinearHead, reading: Reading) -> float:
    """P(router) of the prompt or of its most router-like sentence."""
    return float(head.proba(guard_view(reading))[:, head.classes.index(ROUTER)].max())


def injection_prediction(head: LinearHead, reading: Reading) -> Prediction:
    """The head's answer: ``router`` when P(router) reaches the fitted cut (``meta.threshold``)."""
    p = router_probability(head, reading)
    cut = float(head.meta.get("threshold", 0.5))
    other = next(c for c in head.classes if c != ROUTER)
    label = ROUTER if p >= cut else other
    return Prediction(label, p if label == ROUTER else 1.0 - p, {ROUTER: p, other: 1.0 - p})
