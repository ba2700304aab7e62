"""Fit the option scorer on dev rows of the typed sets, calibrate it per type, measure it on test rows.

One linear model per question type, fitted as a conditional logit: the softmax over a question's
options of (pair features @ w), maximised on the answer with an L2 penalty (the multinomial
objective of scikit-learn's LogisticRegression, over a varying set of options; for two options it
is exactly a logistic regression on the difference of the two feature rows). The temperature of
each type is fitted on a hash-held-back part of its dev rows, never on the rows the weights saw.
Only ``test`` rows are measured.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Protocol

import numpy as np

from classifiers import datasets
from classifiers.calibration import ece, fit_temperature
from classifiers.heads import softmax
from classifiers.options import DEFAULT_FEATURES, OptionHead, pair_features, question_text
from classifiers.training.fit import FitReport, held_back

QUESTION_TYPES = ("choice", "yes_no")
FIT_SETS = {"choice": ("mmlu_pro",), "yes_no": ("boolq", "strategyqa")}  # the typed sets with dev rows
MEASURE_SETS = (
    "mmlu_pro",
    "mmlu_redux",
    "boolq",
    "strategyqa",
    "commonsenseqa",
    "openbookqa",
    "piqa",
    "siqa",
    "logiqa",
    "hellaswag",
    "truthfulqa_mc1",
)
TEST_CAP = 1000  # test rows measured per set: a seeded sample
C = {"choice": 0.01, "yes_no": 0.001}  # inverse L2 strength per type (5-fold CV on the fit rows)
PAD = -1e9  # logit of a missing option when ragged questions are stacked into one matrix


class Embedder(Protocol):
    def embed(self, texts: list[str]) -> np.ndarray: ...


@dataclass(frozen=True)
class Item:
    id: str
    source: str
    type: str
    question: str  # what is embedded: question_text(question, context)
    options: tuple[str, ...]
    answer: int


@dataclass
class Embedded:
    items: list[Item]
    questions: np.ndarray  # (n, dim)
    options: list[np.ndarray]  # per item (n_options, dim)

    def of_type(self, qtype: str) -> Embedded:
        return self.subset(np.array([it.type == qtype for it in self.items], dtype=bool))

    def subset(self, mask: np.ndarray) -> Embedded:
        keep = np.flatnonzero(mask)
        return Embedded([self.items[i] for i in keep], self.questions[keep], [self.options[i] for i in keep])

    @property
    def answers(self) -> np.ndarray:
        return np.array([it.answer for it in self.items], dtype=np.int64)


def _bucket(id_: str, salt: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{salt}:{id_}".encode()).digest()[:4], "big")


def load_items(data_dir: Path, name: str, split: str, cap: int | None = None) -> list[Item]:
    """The choice / yes_no rows of one typed set and split, at most ``cap`` of them chosen by a
    seeded hash of their ids (in file order)."""
    out = []
    for row in datasets.read_jsonl(datasets.find(data_dir, "typed", name)):
        if row["split"] != split or row["type"] not in QUESTION_TYPES or not row.get("options"):
            continue
        options = tuple(row["options"])
        if row["answer"] not in options:
            continue
        out.append(
            Item(
                row["id"],
                name,
                row["type"],
                question_text(row["question"], row.get("context")),
                options,
                options.index(row["answer"]),
            )
        )
    if cap is not None and len(out) > cap:
        keep = set(sorted(range(len(out)), key=lambda i: _bucket(out[i].id, f"options-{name}-{split}"))[:cap])
        out = [it for i, it in enumerate(out) if i in keep]
    return out


def embed_items(cache: Embedder, items: list[Item]) -> Embedded:
    """Questions and options in one call to the cache (each distinct text is embedded once)."""
    texts = [it.question for it in items] + [o for it in items for o in it.options]
    vectors = cache.embed(texts)
    questions, flat = vectors[: len(items)], vectors[len(items) :]
    starts = np.cumsum([0] + [len(it.options) for it in items])
    return Embedded(items, questions, [flat[a:b] for a, b in pairwise(starts)])


def design(emb: Embedded, features: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Stacked pair features ``(n_pairs, width)`` and the first row of each item (n + 1 offsets)."""
    blocks = [pair_features(q, o, features) for q, o in zip(emb.questions, emb.options, strict=True)]
    starts = np.cumsum([0] + [len(b) for b in blocks])
    return np.vstack(blocks), starts


def _segment_softmax(z: np.ndarray, starts: np.ndarray) -> np.ndarray:
    counts = np.diff(starts)
    z = z - np.repeat(np.maximum.reduceat(z, starts[:-1]), counts)
    e = np.exp(z)
    return e / np.repeat(np.add.reduceat(e, starts[:-1]), counts)


def fit_weights(x: np.ndarray, starts: np.ndarray, y: np.ndarray, c: float) -> np.ndarray:
    """Conditional logit: minimise ``c * sum(-log softmax_i[y_i]) + |w|^2 / 2`` over standardised
    columns (so the penalty treats every feature block alike), then fold the scale into ``w``."""
    from scipy.optimize import minimize

    scale = x.std(axis=0).astype(np.float64) + 1e-6
    xs = (x / scale).astype(np.float32)
    gold = starts[:-1] + y

    def objective(w: np.ndarray) -> tuple[float, np.ndarray]:
        z = xs @ w.astype(np.float32)
        p = _segment_softmax(z.astype(np.float64), starts)
        loss = -np.log(np.clip(p[gold], 1e-300, 1.0)).sum()
        p[gold] -= 1.0
        grad = (xs.T @ p.astype(np.float32)).astype(np.float64)
        return c * loss + 0.5 * float(w @ w), c * grad + w

    res = minimize(objective, np.zeros(x.shape[1]), jac=True, method="L-BFGS-B", options={"maxiter": 2000})
    return (res.x / scale).astype(np.float32)


def stacked_logits(head: OptionHead, qtype: str, emb: Embedded) -> np.ndarray:
    """Raw logits ``(n, max_options)``, padded with PAD where a question has fewer options."""
    width = max((len(o) for o in emb.options), default=1)
    out = np.full((len(emb.items), width), PAD, dtype=np.float64)
    for i, (q, o) in enumerate(zip(emb.questions, emb.options, strict=True)):
        out[i, : len(o)] = head.logits(qtype, q, o)
    return out


@dataclass(frozen=True)
class TypeFit(FitReport):
    """A linear head's fit report, for one question type."""

    qtype: str


def fit_type(
    qtype: str,
    emb: Embedded,
    *,
    c: float,
    features: tuple[str, ...] = DEFAULT_FEATURES,
    calibration_fraction: float = 0.2,
) -> tuple[np.ndarray, TypeFit, np.ndarray]:
    """Weights for one question type on the non-held-back rows, its temperature on the rest, and
    the mask of the held-back rows."""
    calib = held_back([it.id for it in emb.items], calibration_fraction)
    if calib.all() or not calib.any():
        calib = np.arange(len(emb.items)) % 5 == 0  # tiny sets: every fifth row
    fit = emb.subset(~calib)
    x, starts = design(fit, features)
    w = fit_weights(x, starts, fit.answers, c)
    dim = emb.questions.shape[1]
    head = OptionHead({qtype: w}, {qtype: 1.0}, features, dim)
    held = emb.subset(calib)
    logits, y = stacked_logits(head, qtype, held), held.answers
    t = fit_temperature(logits, y)
    before, after = softmax(logits), softmax(logits / t)
    correct = before.argmax(1) == y
    return (
        w,
        TypeFit(
            len(fit.items),
            len(held.items),
            float(correct.mean()),
            ece(before.max(1), correct),
            ece(after.max(1), correct),
            t,
            qtype,
        ),
        calib,
    )


@dataclass
class OptionsFit:
    head: OptionHead
    fits: list[TypeFit]
    fitted: np.ndarray  # question embeddings the weights were fitted on (for the familiarity reference)
    held: np.ndarray  # question embeddings held back for the temperatures


def fit_option_head(
    data_dir: Path,
    cache: Embedder,
    *,
    limit: int | None = None,
    c: dict[str, float] | None = None,
    features: tuple[str, ...] = DEFAULT_FEATURES,
    say: Callable[[str], None] = print,
) -> OptionsFit:
    """Fit one model per question type on the dev rows of ``FIT_SETS`` (``limit`` rows per set at most)."""
    strengths = {**C, **(c or {})}
    weights, temperatures, fits, fitted, held = {}, {}, [], [], []
    for qtype, names in FIT_SETS.items():
        items = [it for name in names for it in load_items(data_dir, name, "dev", limit)]
        say(f"options/{qtype}: embedding {len(items)} dev questions and their options")
        emb = embed_items(cache, items).of_type(qtype)
        w, report, calib = fit_type(qtype, emb, c=strengths[qtype], features=features)
        weights[qtype], temperatures[qtype] = w, report.temperature
        fits.append(report)
        fitted.append(emb.questions[~calib])
        held.append(emb.questions[calib])
    meta = {
        "fit": {f.qtype: {k: v for k, v in vars(f).items() if k != "qtype"} for f in fits},
        "c": strengths,
        "fit_sets": {k: list(v) for k, v in FIT_SETS.items()},
    }
    head = OptionHead(weights, temperatures, features, fitted[0].shape[1], meta)
    return OptionsFit(head, fits, np.vstack(fitted), np.vstack(held))


@dataclass(frozen=True)
class SetResult:
    name: str  # the typed set
    qtype: str
    n: int
    accuracy: float
    chance: float  # mean of 1 / n_options
    majority: float | None  # yes_no: accuracy of always giving the set's most common answer
    ece: float  # after the fitted temperature
    ece_uncalibrated: float  # at temperature 1


def measure_set(head: OptionHead, name: str, emb: Embedded) -> SetResult | None:
    types = {it.type for it in emb.items} & set(head.types)
    if len(types) != 1:
        return None
    (qtype,) = types
    emb = emb.of_type(qtype)
    logits, y = stacked_logits(head, qtype, emb), emb.answers
    probs, raw = softmax(logits / head.temperature(qtype)), softmax(logits)
    correct = probs.argmax(1) == y
    majority = None
    if qtype == "yes_no":
        answers = [it.options[it.answer] for it in emb.items]
        majority = max(answers.count(a) for a in set(answers)) / len(answers)
    return SetResult(
        name,
        qtype,
        len(y),
        float(correct.mean()),
        float(np.mean([1 / len(it.options) for it in emb.items])),
        majority,
        ece(probs.max(1), correct),
        ece(raw.max(1), raw.argmax(1) == y),
    )


def measure_options(
    head: OptionHead,
    data_dir: Path,
    cache: Embedder,
    *,
    cap: int | None = TEST_CAP,
    sets: Sequence[str] = MEASURE_SETS,
    say: Callable[[str], None] = print,
) -> list[SetResult]:
    """Accuracy, chance, majority (yes_no) and ECE on the ``test`` rows of every typed set (a
    seeded sample of ``cap`` rows each); sets missing from ``data_dir`` are skipped."""
    out = []
    for name in sets:
        try:
            items = load_items(data_dir, name, "test", cap)
        except FileNotFoundError:
            continue
        say(f"options: measuring on {len(items)} {name} test questions")
        result = measure_set(head, name, embed_items(cache, items))
        if result is not None:
            out.append(result)
    return out


def train_options(
    data_dir: Path, out: Path, cache: Embedder, *, limit: int | None = None, say: Callable[[str], None] = print
) -> tuple[OptionsFit, list[SetResult], float]:
    """Fit, save (``out/options.npz`` + ``.json``) and measure the option head; seconds taken last."""
    t0 = time.perf_counter()
    fitted = fit_option_head(data_dir, cache, limit=limit, say=say)
    fitted.head.save(out)
    results = measure_options(fitted.head, data_dir, cache, cap=limit if limit is not None else TEST_CAP, say=say)
    return fitted, results, time.perf_counter() - t0
