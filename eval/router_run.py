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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from classifiers.training.model_labels import LabelSet, folds, group_folds
from classifiers.training.quality_training import fit_quality, quality_ece
from classifiers.training.router_training import fit_router, labels_for
from eval.router_eval import RouterReport, evaluate
from policies.routed import candidate_costs, candidate_label, prompt_tokens
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


input_tokens = prompt_tokens  # the gateway's own estimate for the expected cost


def measure(
    policy: Policy,
    name: str,
    vm: RoutedModel,
    data_dir: Path,
    embed: Embed,
    cv_by: str = "row",
) -> RouterRun:
    labels = labels_for(vm, data_dir)
    names = [candidate_label(c.model, c.reasoning) for c in vm.candidates]
    dev, test = labels.split("dev"), labels.split("test")
    prune = vm.prune_dominated
    if len(dev) and len(test):
        fit = fit_router(policy, name, vm, dev, embed(dev.texts))
        quality = fit.head.proba(embed(test.texts))
        costs = candidate_costs(policy, vm, input_tokens(test.texts))
        chosen_from = pruned(quality, costs, fit.head.dev_accuracy if prune else None)
        protocol, learner = "dev -> test", f"{fit.head.meta['learner']} {fit.head.meta['setting']}"
    else:
        test = dev = labels
        x = embed(labels.texts)
        fold = group_folds(labels.categories, FOLDS) if cv_by == "category" else folds(labels.ids, FOLDS)
        costs = candidate_costs(policy, vm, input_tokens(test.texts))
        quality, chosen_from, chosen = out_of_fold(name, vm, labels, x, costs, fold, vm.learners)
        protocol = f"{FOLDS}-fold cross-validation" + (", category-disjoint folds" if cv_by == "category" else "")
        learner = ", ".join(sorted(set(chosen)))
    report = evaluate(
        name, names, chosen_from, test.correct, costs, test.categories, dev.correct, dev.categories, vm.rule
    )
    return RouterRun(report, protocol, learner, quality_ece(quality, test.correct), quality, costs, test)


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
