"""``triage eval --router``: fit a routed model's quality heads on dev rows, predict test rows, and
measure the router against its baselines (:mod:`eval.router_eval`), in money from the policy's prices.

A labels file without both dev and test rows (RouteLLM's GSM8K: test only; BBH: dev only) is
cross-validated: five folds by a hash of the row id (``cv_by="row"``) or of its category
(``cv_by="category"``: BBH's tasks, so that no task is both fitted and measured), each predicted by
heads fitted on the other four; its category table is then fitted on every row (a slight advantage
to that baseline; with task-disjoint folds it is an oracle of the task).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from classifiers.quality import joint_features, read_rows
from classifiers.training.model_labels import LabelSet, folds, group_folds
from classifiers.training.quality_training import fit_quality, quality_ece
from classifiers.training.router_training import Hidden, fit_router, labels_for
from eval.router_eval import RouterReport, evaluate
from policies.routed import candidate_costs, candidate_label, close_rows, prompt_tokens
from policies.routed import prune as pruned
from policies.schema import Policy, RoutedModel

FOLDS = 5
Embed = Callable[[list[str]], np.ndarray]


@dataclass
class RouterRun:
    report: RouterReport
    protocol: str  # "dev -> test" or "5-fold cross-validation"
    learner: str
    test_ece: float
    quality: np.ndarray  # test rows' predictions (rows, candidates), before pruning
    costs: np.ndarray  # test rows' expected costs (rows, candidates)
    labels: LabelSet  # the test rows
    probe: ProbeRun | None = None  # where the routed model has a probe: what it did (``report`` is with it)


@dataclass
class ProbeRun:
    margin: float
    probed_share: float  # of the test rows, read by the probe (the first head's choice within the margin)
    cost_per_call: float
    without: RouterReport  # the same rows routed by the first head alone


input_tokens = prompt_tokens  # the gateway's own estimate for the expected cost


def measure(
    policy: Policy,
    name: str,
    vm: RoutedModel,
    data_dir: Path,
    embed: Embed,
    cv_by: str = "row",
    hidden: Hidden | None = None,
    caps: tuple[int | None, int | None] = (None, None),
) -> RouterRun:
    """The router on the test rows, as served: with a ``probe`` on the routed model (and ``hidden``,
    its readings), the probe's head predicts where the first head's two best are within its margin,
    and its readings' cost is counted; the report of the first head alone is kept beside. ``caps``: at
    most this many dev and test rows, a seeded sample (:meth:`LabelSet.sample`; a file without both
    splits, cross-validated: at most the first cap of its rows)."""
    labels = labels_for(vm, data_dir)
    dev, test = labels.split("dev").sample(caps[0]), labels.split("test").sample(caps[1])
    split = bool(len(dev) and len(test))
    if not split:
        labels = labels.sample(caps[0])
        test = dev = labels
    fold = None if split else group_folds(labels.categories, FOLDS) if cv_by == "category" else folds(labels.ids, FOLDS)
    costs = candidate_costs(policy, vm, input_tokens(test.texts))

    def predicted(features: Callable[[list[str]], np.ndarray]) -> tuple[np.ndarray, np.ndarray, str]:
        """The test rows' P(right), the same pruned as served, and the learner(s)."""
        if fold is None:
            fit = fit_router(policy, name, vm, dev, features(dev.texts))
            quality = fit.head.proba(features(test.texts))
            chosen_from = pruned(quality, costs, fit.head.dev_accuracy if vm.prune_dominated else None)
            return quality, chosen_from, f"{fit.head.meta['learner']} {fit.head.meta['setting']}"
        quality, chosen_from, chosen = out_of_fold(name, vm, labels, features(labels.texts), costs, fold, vm.learners)
        return quality, chosen_from, ", ".join(sorted(set(chosen)))

    quality, chosen_from, learner = predicted(embed)
    protocol = "dev -> test" if split else f"{FOLDS}-fold cross-validation"
    protocol += ", category-disjoint folds" if cv_by == "category" and not split else ""
    protocol += f", a seeded sample of {len(dev)} dev rows" if split and caps[0] is not None else ""
    names = [candidate_label(c.model, c.reasoning) for c in vm.candidates]

    def report_of(chosen: np.ndarray, extra: float = 0.0) -> RouterReport:
        return evaluate(
            name, names, chosen, test.correct, costs, test.categories, dev.correct, dev.categories, vm.rule, extra
        )

    if vm.probe is None or hidden is None:
        return RouterRun(
            report_of(chosen_from), protocol, learner, quality_ece(quality, test.correct), quality, costs, test
        )
    read = hidden(vm.probe.backend)
    q2, chosen2, learner2 = predicted(lambda texts: joint_features(embed(texts), read(texts)))
    probed = close_rows(chosen_from, vm.probe.margin) & read_rows(read(test.texts))  # as served: read ones only
    gated_q = np.where(probed[:, None], q2, quality)
    gated = np.where(probed[:, None], chosen2, chosen_from)
    probe = ProbeRun(vm.probe.margin, float(probed.mean()), vm.probe.cost_per_call, report_of(chosen_from))
    report = report_of(gated, vm.probe.cost_per_call * float(probed.mean()))
    learner = f"{learner}; where probed {learner2}"
    return RouterRun(report, protocol, learner, quality_ece(gated_q, test.correct), gated_q, costs, test, probe)


def out_of_fold(
    name: str,
    vm: RoutedModel,
    labels: LabelSet,
    x: np.ndarray,
    costs: np.ndarray,
    fold: np.ndarray,
    learners: Sequence[str] | None,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Each fold's rows predicted by heads fitted on the other folds: P(right), the same pruned as
    the served router prunes (:func:`policies.routed.prune`), and each fold's learner."""
    quality = np.zeros(labels.correct.shape)
    chosen_from = np.zeros(labels.correct.shape)
    chosen = []
    for k in np.unique(fold):
        inside = fold != k
        fit = fit_quality(
            name,
            labels.models,
            x[inside],
            labels.correct[inside],
            [i for i, m in zip(labels.ids, inside, strict=True) if m],
            learners=learners,
            categories=[c for c, m in zip(labels.categories, inside, strict=True) if m],
            cost=costs[inside],
        )
        quality[~inside] = fit.head.proba(x[~inside])
        accuracy = fit.head.dev_accuracy if vm.prune_dominated else None
        chosen_from[~inside] = pruned(quality[~inside], costs[~inside], accuracy)
        chosen.append(f"{fit.head.meta['learner']} {fit.head.meta['setting']}")
    return quality, chosen_from, chosen


def report_doc(
    result: RouterRun, name: str, vm: RoutedModel, caps: tuple[int | None, int | None], reading_ms: float | None
) -> dict[str, Any]:
    """``router-NAME.json``'s document; ``reading_ms``: the probe's median reading time, where it read."""
    doc = {
        "virtual_model": name,
        "labels": vm.labels,
        "protocol": result.protocol,
        "caps": {"dev": caps[0], "test": caps[1]},  # a seeded sample of at most so many rows (None: all)
        "learner": result.learner,
        "test_ece": result.test_ece,
        **asdict(result.report),
    }
    if result.probe is not None and vm.probe is not None:
        doc["probe"] = {**asdict(result.probe), "reading_ms_p50": reading_ms}
    return doc


def missed(report: RouterReport, fail_under: str | None) -> list[str]:
    """The ``--fail-under`` gates (``apgr=0.5,...``: the two-model measures, at least) the report misses."""
    limits = {}
    for part in filter(None, (fail_under or "").split(",")):
        key, _, value = part.partition("=")
        limits[key.strip()] = float(value)
    return [
        f"{k} {v:.3f} < {limits[k]}"
        for k, v in report.two_model.items()
        if k in limits and isinstance(v, float) and v < limits[k]
    ]
