"""The encoder tier at run time: one embedding per prompt, every head read from it.

``Classifier.load`` opens the exported encoder and the trained heads named by the policy; a
missing artifact is a clear start-up error naming the file and the command that builds it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from classifiers.encoder import Encoder, EncoderSettings
from classifiers.heads import LinearHead, Prediction
from classifiers.options import OPTIONS, OptionHead
from gateway.errors import NotReady
from policies.schema import Classifier as ClassifierConfig

REFERENCE = "reference"


def artifacts_dir(cfg: ClassifierConfig, policy_dir: Path) -> Path:
    return (policy_dir / cfg.artifacts).resolve()


def data_dir(cfg: ClassifierConfig, policy_dir: Path) -> Path:
    return (policy_dir / cfg.data_dir).resolve()


@dataclass(frozen=True)
class Familiarity:
    """How close a prompt is to anything the heads were trained on (max cosine similarity)."""

    similarity: float
    threshold: float

    @property
    def in_distribution(self) -> bool:
        return self.similarity >= self.threshold


@dataclass(frozen=True)
class Classification:
    heads: dict[str, Prediction]
    familiarity: Familiarity
    tokens: int
    truncated: bool
    latency_ms: float


class Reference:
    """A sample of training embeddings and the similarity below which a prompt is unfamiliar."""

    def __init__(self, vectors: np.ndarray, threshold: float) -> None:
        self.vectors = vectors.astype(np.float32)
        self.threshold = threshold

    def familiarity(self, x: np.ndarray) -> np.ndarray:
        return (np.atleast_2d(x) @ self.vectors.T).max(axis=1)

    def save(self, directory: Path, meta: dict[str, object]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / f"{REFERENCE}.npz", vectors=self.vectors.astype(np.float16))
        (directory / f"{REFERENCE}.json").write_text(json.dumps({"threshold": self.threshold, **meta}, indent=2))

    @classmethod
    def load(cls, directory: Path, hint: str) -> Reference:
        doc, arr = directory / f"{REFERENCE}.json", directory / f"{REFERENCE}.npz"
        for path in (doc, arr):
            if not path.is_file():
                raise NotReady(f"classifier artifact {path} is missing: build it with `{hint}`")
        with np.load(arr, allow_pickle=False) as a:
            vectors = a["vectors"].astype(np.float32)
        return cls(vectors, float(json.loads(doc.read_text())["threshold"]))


class Classifier:
    def __init__(self, encoder: Encoder, heads: dict[str, LinearHead], reference: Reference,
                 options: OptionHead | None = None) -> None:
        self.encoder = encoder
        self.heads = heads
        self.reference = reference
        self.options = options  # the generic option scorer (typed questions without a task head)

    @classmethod
    def load(cls, cfg: ClassifierConfig, policy_dir: Path, policy_file: str = "POLICY") -> Classifier:
        hint = f"triage train --policy {policy_file}"
        root = artifacts_dir(cfg, policy_dir)
        names = [name for name in [*cfg.heads, *cfg.tasks] if name != OPTIONS]
        heads = {name: LinearHead.load(root, name, hint) for name in names}
        options = OptionHead.load(root, hint) if OPTIONS in cfg.heads else None
        reference = Reference.load(root, hint)
        e = cfg.encoder
        encoder = Encoder.load(EncoderSettings(precision=e.precision, intra_op_threads=e.threads,
                                               provider=e.provider, max_tokens=e.max_tokens, rows=e.rows))
        for name, head in heads.items():
            if head.dim != encoder.dim:
                raise NotReady(f"head {name} expects {head.dim}-d embeddings, the encoder gives {encoder.dim}: "
                               f"retrain with `{hint}`")
        if options is not None and options.dim != encoder.dim:
            raise NotReady(f"the option head expects {options.dim}-d embeddings, the encoder gives {encoder.dim}: "
                           f"retrain with `{hint}`")
        return cls(encoder, heads, reference, options)

    def classify_vectors(self, x: np.ndarray) -> list[tuple[dict[str, Prediction], Familiarity]]:
        per_head = {name: head.predict(x) for name, head in self.heads.items()}
        sims = self.reference.familiarity(x)
        return [({name: preds[i] for name, preds in per_head.items()},
                 Familiarity(float(sims[i]), self.reference.threshold)) for i in range(len(x))]

    def classify(self, text: str | bytes) -> Classification:
        t0 = time.perf_counter()
        encoded = self.encoder.encode(text)
        x = self.encoder.embed([text])
        [(heads, fam)] = self.classify_vectors(x)
        return Classification(heads, fam, encoded.original_tokens, encoded.truncated,
                              (time.perf_counter() - t0) * 1000)
