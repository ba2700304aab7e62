"""Tier 0 for typed questions that have no task head: a generic option scorer on the embedding.

The question (with its context) and each option are embedded apart, by the same encoder, as
unit vectors. Every (question, option) pair becomes a feature vector (:func:`pair_features`); a
linear model per question type turns it into one score per option, and a softmax over the
question's options, with a temperature fitted per type on held-back dev rows, gives the option
probabilities. The scores have no bias: a constant added to every option of a question changes
nothing after the softmax. ``yes_no`` questions always offer ``yes`` and ``no``, so there the
model is in effect P(yes | question).

Serving needs only numpy: one weight vector per question type and the names of the feature
blocks, saved as ``options.npz`` (arrays) + ``options.json`` (everything else). Fitting lives in
:mod:`classifiers.training.options_training`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from classifiers.heads import softmax
from policies.errors import NotReady

OPTIONS = "options"  # artifact name: options.npz + options.json
FORMAT = 1
DEFAULT_BUILD_HINT = "triage train --policy POLICY"

Block = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (q (dim,), options (n, dim)) -> (n, width)


def _dot(q: np.ndarray, o: np.ndarray) -> np.ndarray:
    return (o @ q)[:, None]


def _dot_z(q: np.ndarray, o: np.ndarray) -> np.ndarray:
    """Cosine to the question, standardised over the question's options (0 for a lone option)."""
    s = o @ q
    return ((s - s.mean()) / (s.std() + 0.02))[:, None]


def _typicality(q: np.ndarray, o: np.ndarray) -> np.ndarray:
    """Mean cosine of an option to the question's other options (0 for a lone option)."""
    n = len(o)
    if n < 2:
        return np.zeros((n, 1), dtype=np.float32)
    s = o @ o.T
    return ((s.sum(axis=1) - np.diag(s)) / (n - 1))[:, None]


# name -> (width in units of the embedding dimension, extra columns, function)
BLOCKS: dict[str, tuple[int, int, Block]] = {
    "prod": (1, 0, lambda q, o: o * q),  # elementwise q*o: which shared directions matter
    "absdiff": (1, 0, lambda q, o: np.abs(o - q)),  # |q-o|: where the two differ
    "option": (1, 0, lambda q, o: o),  # the option alone: priors such as "none of the above", "yes"
    "dot": (0, 1, _dot),
    "dot_z": (0, 1, _dot_z),
    "typicality": (0, 1, _typicality),
}
# Chosen by 5-fold cross-validation on the MMLU-Pro and BoolQ + StrategyQA dev rows (never test): the
# interaction blocks (prod, absdiff) fitted noise (MMLU-Pro 16.8% against 18.5% without them), and
# next to nothing (BoolQ + StrategyQA 57.4% against 56.6%, the share of the common answer) for yes_no.
DEFAULT_FEATURES = ("option", "dot", "dot_z", "typicality")


def question_text(question: str, context: str | None) -> str:
    """What is embedded for the question side: the context (passage) first, then the question,
    so that the encoder's head-and-tail truncation keeps the question of a long passage."""
    if context and context.strip():
        return f"{context.strip()}\n\n{question.strip()}"
    return question.strip()


def feature_width(features: tuple[str, ...], dim: int) -> int:
    return sum(BLOCKS[f][0] * dim + BLOCKS[f][1] for f in features)


def pair_features(
    question_vec: np.ndarray, option_vecs: np.ndarray, features: tuple[str, ...] = DEFAULT_FEATURES
) -> np.ndarray:
    """One row per option: the named feature blocks of (question, option), float32 ``(n, width)``."""
    q = np.asarray(question_vec, dtype=np.float32).reshape(-1)
    o = np.atleast_2d(np.asarray(option_vecs, dtype=np.float32))
    if o.shape[1] != q.shape[0]:
        raise ValueError(f"question is {q.shape[0]}-d but options are {o.shape[1]}-d")
    return np.hstack([BLOCKS[f][2](q, o).astype(np.float32, copy=False) for f in features])


@dataclass(frozen=True, eq=False)
class OptionHead:
    weights: Mapping[str, np.ndarray]  # question type -> (width,)
    temperatures: Mapping[str, float]  # question type -> temperature (1.0 = raw)
    features: tuple[str, ...] = DEFAULT_FEATURES
    dim: int = 384
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [f for f in self.features if f not in BLOCKS]
        if unknown:
            raise ValueError(f"option head: unknown feature blocks {unknown}")
        width = feature_width(self.features, self.dim)
        for qtype, w in self.weights.items():
            if w.shape != (width,):
                raise ValueError(f"option head: weights for {qtype} are {w.shape}, features give ({width},)")
            if not self.temperatures.get(qtype, 1.0) > 0:
                raise ValueError(f"option head: temperature for {qtype} must be positive")

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(self.weights)

    def _weight(self, qtype: str) -> np.ndarray:
        try:
            return self.weights[qtype]
        except KeyError:
            raise KeyError(
                f"option head has no weights for question type {qtype!r} (it has {', '.join(self.types) or 'none'})"
            ) from None

    def logits(self, qtype: str, question_vec: np.ndarray, option_vecs: np.ndarray) -> np.ndarray:
        """Raw scores ``(n_options,)``, before the temperature; KeyError for a type without weights."""
        w = self._weight(qtype)
        return pair_features(question_vec, option_vecs, self.features) @ w

    def temperature(self, qtype: str) -> float:
        self._weight(qtype)
        return float(self.temperatures.get(qtype, 1.0))

    def proba(
        self, qtype: str, question_vec: np.ndarray, option_vecs: np.ndarray, temperature: float | None = None
    ) -> np.ndarray:
        """Option probabilities: softmax(logits / temperature), the fitted one unless given."""
        t = temperature if temperature is not None else self.temperature(qtype)
        return softmax(self.logits(qtype, question_vec, option_vecs).astype(np.float64) / t)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(
            directory / f"{OPTIONS}.npz",
            allow_pickle=True,  # numpy's default, named so that the arrays below are never read as it
            **{qtype: w.astype(np.float32) for qtype, w in self.weights.items()},
        )
        doc = {
            "format": FORMAT,
            "features": list(self.features),
            "dim": self.dim,
            "types": list(self.types),
            "temperatures": {t: float(self.temperatures.get(t, 1.0)) for t in self.types},
            "meta": self.meta,
        }
        (directory / f"{OPTIONS}.json").write_text(json.dumps(doc, indent=2, sort_keys=True))

    @classmethod
    def load(cls, directory: Path, hint: str = DEFAULT_BUILD_HINT) -> OptionHead:
        doc_path, arr_path = directory / f"{OPTIONS}.json", directory / f"{OPTIONS}.npz"
        for path in (doc_path, arr_path):
            if not path.is_file():
                raise NotReady(f"option head artifact {path} is missing: build it with `{hint}`")
        doc = json.loads(doc_path.read_text())
        features = tuple(doc.get("features", ()))
        if doc.get("format") != FORMAT or any(f not in BLOCKS for f in features):
            raise NotReady(
                f"option head artifact {doc_path} has format {doc.get('format')} and features "
                f"{list(features)}, expected format {FORMAT}: rebuild it with `{hint}`"
            )
        with np.load(arr_path, allow_pickle=False) as arrays:
            missing = [t for t in doc["types"] if t not in arrays.files]
            if missing:
                raise NotReady(
                    f"option head artifact {arr_path} has no weights for {missing}: rebuild it with `{hint}`"
                )
            weights = {t: arrays[t].astype(np.float32) for t in doc["types"]}
        return cls(
            weights,
            {t: float(v) for t, v in doc["temperatures"].items()},
            features,
            int(doc["dim"]),
            doc.get("meta", {}),
        )
