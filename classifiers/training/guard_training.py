"""Fit the guard (the ``injection`` head and the familiarity cuts) and measure it on the probes.

The injection head is a logistic regression on the guard layer's pooled states: positives are generated router-aimed
prompts (:mod:`classifiers.injections`), negatives the other heads' training prompts, the
generated hard negatives, and sentences of the training prompts (pooled as at run time, so a
long prompt's ordinary sentences are not flagged). Its cut is the ``INJECTION_QUANTILE`` of the
held-back negatives' P(router) (prompt or sentence), at least 0.5.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from classifiers import datasets, injections
from classifiers.calibration import ece
from classifiers.guard import (
    FOREIGN_QUANTILE,
    INJECTION_QUANTILE,
    SIMILARITY_QUANTILE,
    Familiarity,
    Reference,
    guard_view,
    injection_prediction,
    router_probability,
)
from classifiers.heads import LinearHead
from classifiers.language import foreign_language
from classifiers.training.fit import fit_head, held_back
from policies.semantic import INJECTION, ROUTER

if TYPE_CHECKING:
    from classifiers.training.embedding_cache import EmbeddingCache

POSITIVES = 3000
NEGATIVE_SEGMENTS = 20_000
WRAP_MAX_WORDS = 40  # ordinary prompts an injection may be wrapped around
# The guard's probe sets are written by hand and kept beside the benchmarks, outside the wheel
# (``benchmarks/probes/ood_probe*.jsonl`` in a checkout): the caller names their folder
# (``triage train --probes``); the packaged code never looks for it.
PROBE_GLOB = "ood_probe*.jsonl"
MIN_CONFIDENCE = 0.5  # a semantic model with this min_confidence escalates a less sure category


@dataclass
class InjectionFit:
    head: LinearHead
    false_flags: float  # share of the test prompts (all ordinary) flagged
    test_rows: int
    ece: float  # of the head's answers to the test prompts
    ece_uncalibrated: float  # the same at temperature 1


def fit_injection(
    cache: EmbeddingCache, negatives: datasets.Rows, test: datasets.Rows, limit: int | None = None
) -> InjectionFit:
    hard = injections.hard_negatives()
    neg = datasets.Rows(negatives.texts + hard.texts, negatives.labels + hard.labels, negatives.ids + hard.ids)
    neg.labels = [injections.CLEAN] * len(neg)
    calib = held_back(neg.ids, 0.2)  # the cut's rows: no generated prompt wraps one of them
    wrap = [t for t, held in zip(negatives.texts, calib, strict=False) if not held and len(t.split()) <= WRAP_MAX_WORDS]
    positives = injections.generate(POSITIVES if limit is None else min(POSITIVES, 4 * limit), wrap)
    r_neg, r_pos = cache.read(neg.texts), cache.read(positives.texts)
    seg_x: list[np.ndarray] = []
    seg_ids: list[str] = []
    for reading, id_, held in zip(r_neg, neg.ids, calib, strict=True):
        if not held:
            seg_x.extend(reading.segments)
            seg_ids.extend(f"{id_}#s{k}" for k in range(len(reading.segments)))
    keep = datasets.subsample(datasets.Rows(seg_ids, seg_ids, seg_ids), NEGATIVE_SEGMENTS, "injection-segments").ids
    chosen = set(keep)
    seg_rows = [(x, i) for x, i in zip(seg_x, seg_ids, strict=True) if i in chosen]
    x = np.vstack(
        [
            np.stack([guard_view(r)[0] for r in r_neg]),
            np.stack([guard_view(r)[0] for r in r_pos]),
            *([np.stack([v for v, _ in seg_rows])] if seg_rows else []),
        ]
    )
    labels = neg.labels + positives.labels + [injections.CLEAN] * len(seg_rows)
    ids = neg.ids + positives.ids + [i for _, i in seg_rows]
    head, _ = fit_head(INJECTION, x, labels, ids, classes=(injections.CLEAN, ROUTER))
    held_scores = [router_probability(head, r) for r, h in zip(r_neg, calib, strict=True) if h]
    cut = max(0.5, float(np.quantile(held_scores, INJECTION_QUANTILE))) if held_scores else 0.5
    head.meta.update(
        threshold=cut, positives=len(positives), hard_negatives=len(hard), negative_sentences=len(seg_rows)
    )
    r_test, eces, flagged = cache.read(test.texts), [], np.zeros(len(test), bool)
    for h in (head, head.with_temperature(1.0)):
        preds = [injection_prediction(h, r) for r in r_test]
        eces.append(ece(np.array([p.confidence for p in preds]), np.array([p.label != ROUTER for p in preds])))
        if h is head:
            flagged = np.array([p.label == ROUTER for p in preds], dtype=bool)
    return InjectionFit(head, float(flagged.mean()) if len(flagged) else 0.0, len(test), eces[0], eces[1])


REFERENCE_ROWS = 1500  # per head: the similarity sample of its fit rows


def reference_sample(x: np.ndarray, labels: Sequence[str], total: int = REFERENCE_ROWS) -> np.ndarray:
    """About ``total`` of a head's fit rows for the similarity sample, an equal share per label (every
    row of a label with fewer), each share spread evenly over the label's rows in their order. A
    uniform sample kept a label in proportion to its rows: the question type's few open prompts, the
    only ones about code and operations, were thinned like its thousands of typed questions."""
    label_array = np.asarray(labels)
    kinds = sorted(set(label_array.tolist()))
    share = max(1, -(-total // max(1, len(kinds))))
    keep = []
    for kind in kinds:
        idx = np.flatnonzero(label_array == kind)
        keep.extend(idx[np.unique(np.linspace(0, len(idx) - 1, min(share, len(idx))).round().astype(int))].tolist())
    return x[sorted(keep)]


def fit_reference(vectors: np.ndarray, held: np.ndarray, foreign: np.ndarray, layers: int) -> Reference:
    """The similarity sample and the familiarity cuts, from held-out training prompts: ``held``
    (embeddings) for the similarity cut, ``foreign`` (their shares of foreign pieces) for the other."""
    sims = (held @ vectors.T).max(axis=1)
    return Reference(
        vectors, float(np.quantile(sims, SIMILARITY_QUANTILE)), float(np.quantile(foreign, FOREIGN_QUANTILE)), layers
    )


@dataclass
class ProbeResult:
    probes: str  # the file
    kind: str  # language, gibberish, injection; benign: every flag is a false one
    n: int
    far: float  # similarity under the cut
    language: float  # another language than English
    foreign: float  # vocabulary over the cut
    router: float  # the injection head says router
    router_whole: float  # ... reading the whole prompt only, no sentences (for comparison)
    guarded: float  # a fixed route: unfamiliar or injection
    doubtful: float  # category confidence under MIN_CONFIDENCE (escalated, not guarded)
    no_confident_class: float  # guarded or doubtful: what the issue asks of an input the heads do not know


def probe(
    cache: EmbeddingCache,
    reference: Reference,
    category: LinearHead | None,
    injection: LinearHead | None,
    ordinary: datasets.Rows,
    probe_dir: Path | None = None,
) -> list[ProbeResult]:
    """The guard on each probe file of ``probe_dir`` (every ``ood_probe*.jsonl``), kind by kind, and
    on ``ordinary`` prompts (the shared data's test rows, kind ``ordinary``: every flag a false one)."""
    files = sorted(probe_dir.glob(PROBE_GLOB)) if probe_dir is not None and probe_dir.is_dir() else []
    sets = [(f.name, list(datasets.read_jsonl(f))) for f in files]
    sets.append(("shared test rows", [{"text": t, "kind": "ordinary"} for t in ordinary.texts]))
    out = []
    for name, rows in sets:
        if not rows:
            continue
        readings = cache.read([r["text"] for r in rows])
        fams: list[Familiarity] = reference.familiarity(readings)
        far = np.array([f.similarity < f.threshold for f in fams])
        foreign = np.array([f.foreign > f.foreign_threshold for f in fams])
        language = np.array([foreign_language(f.language) for f in fams])
        router = np.array(
            [injection is not None and injection_prediction(injection, r).label == ROUTER for r in readings]
        )
        x = np.stack([r.vector for r in readings])
        whole = np.zeros(len(rows), bool)
        if injection is not None:
            cut = float(injection.meta.get("threshold", 0.5))
            shallow = np.stack([guard_view(r)[0] for r in readings])
            whole = injection.proba(shallow)[:, injection.classes.index(ROUTER)] >= cut
        doubtful = category.proba(x).max(axis=1) < MIN_CONFIDENCE if category is not None else np.zeros(len(rows), bool)
        for kind in sorted({r["kind"] for r in rows}):
            m = np.array([r["kind"] == kind for r in rows])
            out.append(
                ProbeResult(
                    name,
                    kind,
                    int(m.sum()),
                    float(far[m].mean()),
                    float(language[m].mean()),
                    float(foreign[m].mean()),
                    float(router[m].mean()),
                    float(whole[m].mean()),
                    float((far | language | foreign | router)[m].mean()),
                    float(doubtful[m].mean()),
                    float((far | language | foreign | router | doubtful)[m].mean()),
                )
            )
    return out
