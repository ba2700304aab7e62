"""Train the quality heads of a policy's routed virtual models (the learned router).

Each routed model names a labels file (``model_labels/...`` or ``reasoning/...``) and its
candidates' columns in it. The head is fitted on the file's ``dev`` rows; a file without dev rows
(RouteLLM's GSM8K) is fitted on every row, and only cross-validated figures can be reported for it
(``triage eval --router``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from classifiers.calibration import auroc
from classifiers.quality import QualityHead, quality_head_name
from classifiers.training import model_labels
from classifiers.training.model_labels import LabelSet
from classifiers.training.quality_training import Candidate, QualityFit, fit_quality, quality_ece
from policies.routed import candidate_costs, prompt_tokens
from policies.schema import Policy, RoutedModel

Embed = Callable[[list[str]], np.ndarray]


class LabelsProblem(ValueError):
    """A routed model's labels file is missing or lacks a candidate's column."""


@dataclass
class RouterResult:
    name: str
    head: QualityHead
    fit_rows: int
    test_rows: int
    tried: list[Candidate]
    test_auroc: dict[str, float]  # per candidate column, P(right) vs right on test rows
    test_ece: float
    fitted_on: str  # "dev" or "all (no dev rows)"


def labels_for(vm: RoutedModel, data_dir: Path) -> LabelSet:
    """The labels file's rows, its columns narrowed to the candidates' (in candidate order)."""
    folder, _, name = vm.labels.rpartition("/")
    try:
        full = model_labels.load(data_dir, name) if folder in ("model_labels", "reasoning", "") else None
    except FileNotFoundError as exc:
        raise LabelsProblem(f"labels {vm.labels}: {exc}") from None
    if full is None:
        raise LabelsProblem(f"labels {vm.labels}: a routed model learns from model_labels/ or reasoning/ files")
    cols = [c.column for c in vm.candidates]
    missing = [c for c in cols if c not in full.models]
    if missing:
        raise LabelsProblem(f"labels {vm.labels} have no column {', '.join(missing)} (has: {', '.join(full.models)})")
    idx = [full.models.index(c) for c in cols]
    return LabelSet(full.name, full.ids, full.splits, full.texts, full.categories, tuple(cols), full.correct[:, idx])


def fit_router(policy: Policy, name: str, vm: RoutedModel, rows: LabelSet, x: np.ndarray) -> QualityFit:
    """The quality head of a routed model on these rows (``x``: their embeddings): its learners,
    the rows' categories, and the policy's prices for the rows' prompts, which choose the learner."""
    return fit_quality(
        name,
        rows.models,
        x,
        rows.correct,
        rows.ids,
        learners=vm.learners,
        categories=rows.categories,
        cost=candidate_costs(policy, vm, prompt_tokens(rows.texts)),
    )


def train_router(policy: Policy, name: str, vm: RoutedModel, data_dir: Path, embed: Embed, out: Path) -> RouterResult:
    """Fit, calibrate and save the quality head of routed model ``name``; measure it on test rows.
    ``embed``: texts -> (rows, dim), the served encoder's embeddings; the policy's prices pick the
    learner (its routing value on held-back dev rows)."""
    labels = labels_for(vm, data_dir)
    dev = labels.split("dev")
    fitted_on = "dev"
    if len(dev) == 0:
        dev, fitted_on = labels, "all (no dev rows)"
    fit = fit_router(policy, quality_head_name(name), vm, dev, embed(dev.texts))
    fit.head.meta.update(labels=vm.labels, fitted_on=fitted_on)
    fit.head.save(out)
    test = labels.split("test")
    aurocs: dict[str, float] = {}
    ece_ = float("nan")
    if len(test) and fitted_on == "dev":
        p = fit.head.proba(embed(test.texts))
        for j, col in enumerate(labels.models):
            known = ~np.isnan(test.correct[:, j])
            right = test.correct[known, j] > 0.5
            aurocs[col] = auroc(p[known, j], right) if right.any() and (~right).any() else float("nan")
        ece_ = quality_ece(p, test.correct)
    return RouterResult(
        name,
        fit.head,
        int(fit.head.meta["fit_rows"]),
        len(test) if fitted_on == "dev" else 0,
        fit.tried,
        aurocs,
        ece_,
        fitted_on,
    )


def train_routers(
    policy: Policy, data_dir: Path, embed: Embed, out: Path, say: Callable[[str], None] = print
) -> list[RouterResult]:
    results = []
    for name, vm in policy.virtual_models.items():
        if isinstance(vm, RoutedModel):
            say(f"router {name}: learning P(right) of {len(vm.candidates)} candidates from {vm.labels}")
            results.append(train_router(policy, name, vm, data_dir, embed, out))
    return results
