"""The encoder tier at run time: one embedding per prompt, every head read from it.

``Classifier.load`` opens the exported encoder and the trained heads named by the policy; a
missing artifact is a clear start-up error naming the file and the command that builds it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from classifiers import layout
from classifiers.artifacts import ExportSettings
from classifiers.encoder import Encoder, EncoderSettings, Reading
from classifiers.guard import Familiarity, Reference, injection_prediction
from classifiers.heads import LinearHead
from classifiers.options import OPTIONS, OptionHead
from policies.errors import NotReady
from policies.schema import ClassifierSpec
from policies.semantic import INJECTION, Prediction


def artifacts_dir(cfg: ClassifierSpec, policy_dir: Path) -> Path:
    return (policy_dir / cfg.artifacts).resolve()


def data_dir(cfg: ClassifierSpec, policy_dir: Path) -> Path:
    return (policy_dir / cfg.data_dir).resolve()


@dataclass(frozen=True)
class Classification:
    heads: dict[str, Prediction]
    familiarity: Familiarity
    tokens: int
    truncated: bool
    latency_ms: float


class Classifier:
    def __init__(
        self, encoder: Encoder, heads: dict[str, LinearHead], reference: Reference, options: OptionHead | None = None
    ) -> None:
        self.encoder = encoder
        self.heads = heads
        self.reference = reference
        self.options = options  # the generic option scorer (typed questions without a task head)

    @classmethod
    def load(cls, cfg: ClassifierSpec, policy_dir: Path, policy_file: str = "POLICY") -> Classifier:
        hint = f"triage train --policy {policy_file}"
        root = artifacts_dir(cfg, policy_dir)
        names = [name for name in [*cfg.heads, *cfg.tasks] if name != OPTIONS]
        heads = {name: LinearHead.load(root, name, hint) for name in names}
        options = OptionHead.load(root, hint) if OPTIONS in cfg.heads else None
        reference = Reference.load(root, hint)
        e = cfg.encoder
        if reference.layers != e.layers:
            raise NotReady(
                f"the heads in {root} were trained on {reference.layers} encoder layers, the policy keeps "
                f"{e.layers}: retrain with `{hint}`"
            )
        encoder = Encoder.load(
            EncoderSettings(
                precision=e.precision,
                intra_op_threads=e.threads,
                provider=e.provider,
                max_tokens=e.max_tokens,
                rows=e.rows,
            ),
            export=ExportSettings(layers=e.layers),
        )
        for name, head in heads.items():
            reads = head.meta.get("layout")
            if reads is not None and reads != layout.NAME:
                raise NotReady(
                    f"head {name} reads layout features '{reads}', this triage computes "
                    f"'{layout.NAME}': retrain with `{hint}`"
                )
            width = encoder.dim + (layout.WIDTH if reads else 0)
            if head.dim != width:
                extra = f" (+{layout.WIDTH} layout features)" if reads else ""
                raise NotReady(
                    f"head {name} expects {head.dim} inputs, the encoder gives {encoder.dim}{extra}: "
                    f"retrain with `{hint}`"
                )
        if options is not None and options.dim != encoder.dim:
            raise NotReady(
                f"the option head expects {options.dim}-d embeddings, the encoder gives {encoder.dim}: "
                f"retrain with `{hint}`"
            )
        return cls(encoder, heads, reference, options)

    def classes(self) -> dict[str, tuple[str, ...]]:
        """Each head's labels, as trained."""
        return {name: head.classes for name, head in self.heads.items()}

    def classify_readings(
        self, readings: list[Reading], texts: Sequence[str | bytes]
    ) -> list[tuple[dict[str, Prediction], Familiarity]]:
        """Every head's answer and the guard's for each prompt (``texts``: the prompts the readings are
        of, for the heads that read their layout too; the injection head reads sentences too)."""
        if len(texts) != len(readings):
            raise ValueError(f"{len(readings)} readings but {len(texts)} texts")
        x = np.stack([r.vector for r in readings]) if readings else np.zeros((0, self.encoder.dim), np.float32)
        laid = layout.beside(x, texts) if any(layout.reads_layout(h.meta) for h in self.heads.values()) else x
        per_head = {
            name: head.predict(laid if layout.reads_layout(head.meta) else x)
            for name, head in self.heads.items()
            if name != INJECTION
        }
        injection = self.heads.get(INJECTION)
        out = []
        for i, (reading, fam) in enumerate(zip(readings, self.reference.familiarity(readings), strict=True)):
            heads = {name: preds[i] for name, preds in per_head.items()}
            if injection is not None:
                heads[INJECTION] = injection_prediction(injection, reading)
            out.append((heads, fam))
        return out

    def classify(self, text: str | bytes) -> Classification:
        t0 = time.perf_counter()
        encoded = self.encoder.encode(text)
        [(heads, fam)] = self.classify_readings(self.encoder.read_encoded([encoded]), [text])
        return Classification(heads, fam, encoded.original_tokens, encoded.truncated, (time.perf_counter() - t0) * 1000)
