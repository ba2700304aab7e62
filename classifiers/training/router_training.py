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
from classifiers.quality import QualityHead, joint_features, probe_head_name, quality_head_name, read_rows
from classifiers.training import model_labels
from classifiers.training.model_labels import LabelSet
from classifiers.training.quality_training import Candidate, QualityFit, fit_quality, quality_ece
from policies.routed import candidate_costs, close_rows, probe_source, prompt_tokens
from policies.routed import prune as pruned
from policies.schema import Policy, RoutedModel

Embed = Callable[[list[str]], np.ndarray]
Hidden = Callable[[str], Embed]  # a gguf_probe backend's name -> texts -> its readings, (rows, width)


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
    probe: ProbeResult | None = None  # the second head, where the routed model has a probe


@dataclass
class ProbeResult:
    head: QualityHead
    test_auroc: dict[str, float]  # per candidate column, the probe head's P(right) vs right on test rows
    test_ece: float
    # of the test rows, those the probe can read where the heads' choice is within its margin (NaN: no test rows)
    probed_share: float


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


def _measured(p: np.ndarray, test: LabelSet) -> tuple[dict[str, float], float]:
    """Per candidate column, the AUROC of P(right) against right on these rows; and the ECE."""
    aurocs: dict[str, float] = {}
    for j, col in enumerate(test.models):
        known = ~np.isnan(test.correct[:, j])
        right = test.correct[known, j] > 0.5
        aurocs[col] = auroc(p[known, j], right) if right.any() and (~right).any() else float("nan")
    return aurocs, quality_ece(p, test.correct)


def train_router(
    policy: Policy,
    name: str,
    vm: RoutedModel,
    data_dir: Path,
    embed: Embed,
    out: Path,
    hidden: Hidden | None = None,
    limit: int | None = None,
) -> RouterResult:
    """Fit, calibrate and save the quality head of routed model ``name``; measure it on test rows.
    ``embed``: texts -> (rows, dim), the served encoder's embeddings; the policy's prices pick the
    learner (its routing value on held-back dev rows). With a ``probe`` on the routed model,
    ``hidden`` reads the rows with its backend and the second head is fitted and saved too.
    ``limit``: at most this many dev and test rows, a seeded sample (:meth:`LabelSet.sample`)."""
    labels = labels_for(vm, data_dir)
    every = labels.split("dev")
    dev = every.sample(limit)
    fitted_on = "dev" if len(dev) == len(every) else f"dev (a sample of {len(dev)})"
    if len(dev) == 0:
        dev, fitted_on = labels.sample(limit), "all (no dev rows)"
    x_dev = embed(dev.texts)
    fit = fit_router(policy, quality_head_name(name), vm, dev, x_dev)
    fit.head.meta.update(labels=vm.labels, fitted_on=fitted_on)
    fit.head.save(out)
    test = labels.split("test").sample(limit)
    measured = bool(len(test)) and fitted_on.startswith("dev")
    aurocs, ece_ = _measured(fit.head.proba(embed(test.texts)), test) if measured else ({}, float("nan"))
    probe = None
    if vm.probe is not None:
        if hidden is None:
            raise LabelsProblem(f"virtual_models.{name}: its probe's readings are needed to fit its second head")
        read = hidden(vm.probe.backend)
        probe = _train_probe(policy, name, vm, fit.head, dev, x_dev, test if measured else None, embed, read)
        probe.head.meta.update(labels=vm.labels, fitted_on=fitted_on)
        probe.head.save(out)
    return RouterResult(
        name,
        fit.head,
        int(fit.head.meta["fit_rows"]),
        len(test) if measured else 0,
        fit.tried,
        aurocs,
        ece_,
        fitted_on,
        probe,
    )


def _train_probe(
    policy: Policy,
    name: str,
    vm: RoutedModel,
    first: QualityHead,
    dev: LabelSet,
    x_dev: np.ndarray,
    test: LabelSet | None,
    embed: Embed,
    read: Embed,
) -> ProbeResult:
    """The probe's head: the same learners on MiniLM's embedding and the probe's reading side by side
    (:func:`classifiers.quality.joint_features`), fitted on every dev row (the served router asks it
    only where the first head's choice is close, but a head fitted on those rows alone would rest on
    a few of them); measured on the test rows the probe reads, with the share the margin sends to
    it (read from ``first``, the first head, as served)."""
    assert vm.probe is not None
    h_dev = read(dev.texts)
    if not read_rows(h_dev).any():
        raise LabelsProblem(f"virtual_models.{name}: its probe {vm.probe.backend} reads none of the dev rows")
    # every dev row, as `triage eval` and `triage calibrate` fit it: a row the probe cannot read (zeros)
    # is never probed when served, and gives the head its embedding's half only
    fit = fit_router(policy, probe_head_name(name), vm, dev, joint_features(x_dev, h_dev))
    fit.head.meta.update(probe=probe_source(policy, vm))
    if test is None:
        return ProbeResult(fit.head, {}, float("nan"), float("nan"))
    x_test, h_test = embed(test.texts), read(test.texts)
    on = read_rows(h_test)
    aurocs, ece_ = (
        _measured(fit.head.proba(joint_features(x_test[on], h_test[on])), test.take(on))
        if on.any()
        else ({}, float("nan"))
    )
    share = float((probed(policy, vm, first, x_test, test.texts) & on).mean())
    return ProbeResult(fit.head, aurocs, ece_, share)


def probed(policy: Policy, vm: RoutedModel, head: QualityHead, x: np.ndarray, texts: list[str]) -> np.ndarray:
    """Which of these rows the served router would probe: the first head's two best candidates, pruned as
    served, within the probe's margin (``head``: the first head; ``x``: the rows' embeddings)."""
    assert vm.probe is not None
    costs = candidate_costs(policy, vm, prompt_tokens(texts))
    q = pruned(head.proba(x), costs, head.dev_accuracy if vm.prune_dominated else None)
    return close_rows(q, vm.probe.margin)


def train_routers(
    policy: Policy,
    data_dir: Path,
    embed: Embed,
    out: Path,
    say: Callable[[str], None] = print,
    hidden: Hidden | None = None,
    limit: int | None = None,
) -> list[RouterResult]:
    results = []
    for name, vm in policy.virtual_models.items():
        if isinstance(vm, RoutedModel):
            say(f"router {name}: learning P(right) of {len(vm.candidates)} candidates from {vm.labels}")
            results.append(train_router(policy, name, vm, data_dir, embed, out, hidden, limit))
    return results
