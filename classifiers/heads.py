"""Linear heads on the sentence embedding, with temperature-scaled probabilities.

Serving needs only numpy: a head is a weight matrix, a bias, its class names and a temperature,
saved as ``<name>.npz`` (arrays) + ``<name>.json`` (everything else). Training (scikit-learn's
logistic regression) lives in :mod:`classifiers.training.fit`; nothing here unpickles anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policies.errors import NotReady
from policies.semantic import Prediction

FORMAT = 1


@dataclass(frozen=True, eq=False)
class LinearHead:
    name: str
    classes: tuple[str, ...]
    weight: np.ndarray  # (n_classes, dim)
    bias: np.ndarray  # (n_classes,)
    temperature: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        k = len(self.classes)
        if self.weight.ndim != 2 or self.weight.shape[0] != k or self.bias.shape != (k,):
            raise ValueError(
                f"head {self.name}: weight {self.weight.shape} / bias {self.bias.shape} do not fit {k} classes"
            )
        if not self.temperature > 0:
            raise ValueError(f"head {self.name}: temperature must be positive")

    @property
    def dim(self) -> int:
        return int(self.weight.shape[1])

    def logits(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32) @ self.weight.T + self.bias

    def proba(self, x: np.ndarray, temperature: float | None = None) -> np.ndarray:
        return softmax(self.logits(x) / (temperature or self.temperature))

    def labels(self, probs: np.ndarray) -> np.ndarray:
        """Class indices: the most probable, except that a task head with an out-of-scope label
        answers it whenever its top probability is under the head's fitted ``oos_threshold``."""
        top = probs.argmax(axis=1)
        oos, threshold = self.meta.get("out_of_scope"), self.meta.get("oos_threshold")
        if oos in self.classes and threshold is not None:
            top = np.where(probs.max(axis=1) < threshold, self.classes.index(oos), top)
        return top

    def predict(self, x: np.ndarray) -> list[Prediction]:
        """Each row's answer; its confidence is the answer's probability, except for an out-of-scope
        answer the cut made (the top class under ``oos_threshold``): 1 - the top class's probability."""
        probs = self.proba(np.atleast_2d(x))
        out = []
        for row, i in zip(probs, self.labels(probs), strict=True):
            top = int(row.argmax())
            confidence = float(row[top]) if int(i) == top else 1.0 - float(row[top])
            out.append(
                Prediction(
                    self.classes[int(i)], confidence, {c: float(p) for c, p in zip(self.classes, row, strict=True)}
                )
            )
        return out

    def with_temperature(self, temperature: float) -> LinearHead:
        return LinearHead(self.name, self.classes, self.weight, self.bias, temperature, dict(self.meta))

    def save(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(
            directory / f"{self.name}.npz", weight=self.weight.astype(np.float32), bias=self.bias.astype(np.float32)
        )
        doc = {
            "format": FORMAT,
            "name": self.name,
            "classes": list(self.classes),
            "temperature": self.temperature,
            "meta": self.meta,
        }
        path = directory / f"{self.name}.json"
        path.write_text(json.dumps(doc, indent=2, sort_keys=True))
        return path

    @classmethod
    def load(cls, directory: Path, name: str, build_hint: str = "triage train --policy POLICY") -> LinearHead:
        doc_path, arr_path = directory / f"{name}.json", directory / f"{name}.npz"
        for path in (doc_path, arr_path):
            if not path.is_file():
                raise NotReady(f"head artifact {path} is missing: build it with `{build_hint}`")
        doc = json.loads(doc_path.read_text())
        if doc.get("format") != FORMAT:
            raise NotReady(
                f"head artifact {doc_path} has format {doc.get('format')}, expected {FORMAT}: "
                f"rebuild it with `{build_hint}`"
            )
        with np.load(arr_path, allow_pickle=False) as arrays:
            weight, bias = arrays["weight"], arrays["bias"]
        return cls(doc["name"], tuple(doc["classes"]), weight, bias, float(doc["temperature"]), doc.get("meta", {}))


def trained_classes(directory: Path, names: list[str]) -> dict[str, tuple[str, ...]]:
    """The labels of each named head trained into ``directory`` (its json alone); heads not trained yet are left out."""
    out = {}
    for name in names:
        path = directory / f"{name}.json"
        try:
            out[name] = tuple(json.loads(path.read_text()).get("classes", ()))
        except (OSError, ValueError, AttributeError):
            continue  # missing or unreadable: loading the head says so, with the command that rebuilds it
    return out


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)
