"""Which model answered which question right: the ``model_labels`` and ``reasoning`` files of the
shared data (see its README), read into one shape for the learned router.

A row's text is the prompt as it reaches the gateway (MMLU-Pro and GSM8K questions rendered from
their typed rows, RouteLLM's MMLU prompt as RouteLLM sent it, BBH and zero-shot-CoT prompts as the
model saw them). ``correct`` is a (rows, models) array of 1.0 / 0.0 and NaN where a model has no
answer for the row. Reasoning files have two candidates, ``direct`` and ``cot`` (the same model with
reasoning off and on).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from classifiers.datasets import find, read_jsonl, render_typed

MT_BENCH_RIGHT = 8  # a GPT-4 judge score from which an MT-Bench answer counts as right (RouteLLM's cut)
REASONING = ("direct", "cot")
# rows sampled for a quicker pass (``--dev-cap`` / ``--test-cap`` with ``--router``, ``triage train --limit``,
# the router-probe bench): the bench's salt, so that readings kept by one serve the others
SAMPLE_SALT = "triage-router-probe"


@dataclass(frozen=True)
class LabelSet:
    name: str
    ids: list[str]
    splits: list[str]
    texts: list[str]
    categories: list[str]  # subject, task or "" when the file has none
    models: tuple[str, ...]
    correct: np.ndarray  # (rows, models) float: 1 right, 0 wrong, NaN no answer

    def __len__(self) -> int:
        return len(self.ids)

    def sample(self, n: int | None, salt: str = SAMPLE_SALT) -> LabelSet:
        """At most ``n`` rows (None: all), those of the smallest SHA-256 of ``salt`` and their id: the
        same rows on every machine, and the rows of a larger sample include a smaller one's."""
        if n is None or n >= len(self):
            return self
        keys = np.array([hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in self.ids])
        keep = np.zeros(len(self), dtype=bool)
        keep[np.argsort(keys)[:n]] = True
        return self.take(keep)

    def take(self, mask: np.ndarray) -> LabelSet:
        idx = np.flatnonzero(mask)
        return LabelSet(
            self.name,
            [self.ids[i] for i in idx],
            [self.splits[i] for i in idx],
            [self.texts[i] for i in idx],
            [self.categories[i] for i in idx],
            self.models,
            self.correct[idx],
        )

    def split(self, name: str) -> LabelSet:
        return self.take(np.array([s == name for s in self.splits], dtype=bool))

    def accuracy(self) -> dict[str, float]:
        """Each model's share right, over the rows it answered."""
        return {m: float(np.nanmean(self.correct[:, j])) for j, m in enumerate(self.models)}


def folds(ids: list[str], k: int, salt: str = "triage-router-folds") -> np.ndarray:
    """A fold number per row, by SHA-256 of salt and id (stable everywhere): for sets with no dev rows."""
    return np.array([int.from_bytes(hashlib.sha256(f"{salt}:{i}".encode()).digest()[:4], "big") % k for i in ids])


def group_folds(groups: list[str], k: int, salt: str = "triage-router-folds") -> np.ndarray:
    """A fold number per row such that each group (a task, a category) lies in one fold: the groups,
    ordered by SHA-256 of salt and name, are dealt to the folds in turn (every fold gets some)."""
    names = sorted(set(groups), key=lambda g: hashlib.sha256(f"{salt}:{g}".encode()).digest())
    if len(names) < k:
        raise ValueError(f"{len(names)} groups cannot fill {k} group-disjoint folds")
    fold_of = {g: i % k for i, g in enumerate(names)}
    return np.array([fold_of[g] for g in groups])


def _typed_index(data_dir: Path, name: str) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in read_jsonl(find(data_dir, "typed", name))}


def _open_index(data_dir: Path, name: str) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in read_jsonl(find(data_dir, "open", name))}


def load(data_dir: Path, name: str) -> LabelSet:
    """``name``: a file of ``model_labels/`` or ``reasoning/`` (without its suffix)."""
    if name in ("bbh_cot_vs_direct", "zero_shot_cot"):
        return _reasoning(data_dir, name)
    rows = list(read_jsonl(find(data_dir, "model_labels", name)))
    if not rows:
        raise ValueError(f"model_labels/{name} has no rows")
    typed: dict[str, dict[str, Any]] = {}
    opened: dict[str, dict[str, Any]] = {}
    if "prompt" not in rows[0] and "turn" not in rows[0]:
        source = rows[0]["question_id"].rsplit("-", 2)[0]
        typed = _typed_index(data_dir, source)
    if "turn" in rows[0]:
        opened = _open_index(data_dir, "mt_bench")
    models = tuple(sorted({m for r in rows for m in (r.get("correct") or r.get("score") or {})}))
    ids, splits, texts, cats, correct = [], [], [], [], []
    for r in rows:
        if "prompt" in r:
            text = r["prompt"]
        elif "turn" in r:
            turns = opened[r["question_id"]]["turns"]
            text = "\n".join(turns[: r["turn"]])
        else:
            text = render_typed(typed[r["question_id"]])
        if "score" in r:
            got = [np.nan if r["score"].get(m) is None else float(r["score"][m] >= MT_BENCH_RIGHT) for m in models]
        else:
            got = [np.nan if r["correct"].get(m) is None else float(r["correct"][m]) for m in models]
        ids.append(r["id"])
        splits.append(r.get("split") or "test")
        texts.append(text)
        cats.append(r.get("category") or "")
        correct.append(got)
    return LabelSet(name, ids, splits, texts, cats, models, np.array(correct, dtype=np.float64))


def _reasoning(data_dir: Path, name: str) -> LabelSet:
    rows = list(read_jsonl(find(data_dir, "reasoning", name)))
    correct = np.array([[float(r["direct_correct"]), float(r["cot_correct"])] for r in rows])
    return LabelSet(
        name,
        [r["id"] for r in rows],
        [r["split"] for r in rows],
        [r["prompt"] for r in rows],
        [r.get("task") or "" for r in rows],
        REASONING,
        correct,
    )
