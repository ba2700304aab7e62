"""The recorded answers a pool's benchmark replays (``python -m benchmarks pool``): MMLU-Pro's 29
models (which option each chose, ``model_labels/mmlu_pro_models``), with the typed rows' options and
gold, and the policy's prices for each row's prompt, as the learned router's evaluation counts them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from classifiers.datasets import find, read_jsonl
from classifiers.service import data_dir
from classifiers.training.model_labels import LabelSet
from classifiers.training.router_training import labels_for
from eval.router_run import input_tokens
from policies.loader import load
from policies.pool import NO_ANSWER
from policies.routed import candidate_costs, candidate_label
from policies.schema import Policy, RoutedModel


@dataclass(frozen=True)
class Recorded:
    labels: LabelSet  # texts, categories, splits, correct (rows, models) in candidate order
    models: list[str]
    answers: np.ndarray  # (rows, models) option index, NO_ANSWER where none was given or parsed
    gold: np.ndarray  # (rows,) option index
    k: np.ndarray  # (rows,) options
    cost: np.ndarray  # (rows, models) a call's expected cost at the policy's prices
    options: list[tuple[str, ...]]  # each row's option texts

    def split(self, name: str) -> Recorded:
        m = np.array([s == name for s in self.labels.splits])
        opts = [o for o, keep in zip(self.options, m, strict=True) if keep]
        return Recorded(self.labels.take(m), self.models, self.answers[m], self.gold[m], self.k[m], self.cost[m], opts)


def routed(policy_path: Path, router: str) -> tuple[Policy, RoutedModel, Path]:
    policy = load(policy_path)
    vm = policy.virtual_models[router]
    assert isinstance(vm, RoutedModel) and policy.classifier is not None
    return policy, vm, data_dir(policy.classifier, policy_path.resolve().parent)


def mmlu_pro(policy_path: Path, router: str) -> Recorded:
    """Every row of the routed model's labels (MMLU-Pro's), each model's chosen option read from its
    recorded letter; a letter that disagrees with the file's own ``correct`` is an error."""
    policy, vm, folder = routed(policy_path, router)
    labels = labels_for(vm, folder)
    models = [candidate_label(c.model, c.reasoning) for c in vm.candidates]
    typed = {r["id"]: r for r in read_jsonl(find(folder, "typed", "mmlu_pro"))}
    preds = {
        r["id"]: (r["question_id"], r["pred"]) for r in read_jsonl(find(folder, "model_labels", "mmlu_pro_models"))
    }
    answers = np.full((len(labels), len(models)), NO_ANSWER, dtype=np.int64)
    gold, k = np.zeros(len(labels), dtype=np.int64), np.zeros(len(labels), dtype=np.int64)
    options = []
    for i, rid in enumerate(labels.ids):
        qid, pred = preds[rid]
        row = typed[qid]
        options.append(tuple(row["options"]))
        k[i] = len(row["options"])
        gold[i] = row["options"].index(row["answer"])
        for j, m in enumerate(labels.models):
            letter = pred.get(m)
            if letter is not None and 0 <= ord(letter) - 65 < k[i]:
                answers[i, j] = ord(letter) - 65
    right = np.nan_to_num(labels.correct, nan=0.0)
    mismatch = float(((answers == gold[:, None]) != (right > 0)).mean())
    if mismatch > 0.001:
        raise ValueError(f"recorded letters disagree with the labels' correct on {mismatch:.2%} of cells")
    cost = candidate_costs(policy, vm, input_tokens(labels.texts))
    return Recorded(labels, models, answers, gold, k, cost, options)


def embeddings(policy_path: Path, router: str, dev: Recorded, test: Recorded) -> tuple[np.ndarray, np.ndarray]:
    """MiniLM's embeddings of the dev and test rows' prompts, from the cache ``triage eval --router`` fills."""
    from gateway.cli.router import _embedder

    policy, _, _ = routed(policy_path, router)
    cache = _embedder(policy, 1)
    try:
        return cache.embed(dev.labels.texts), cache.embed(test.labels.texts)
    finally:
        cache.save()


def heads_prior(
    policy_path: Path, router: str, dev: Recorded, x: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """The learned router's quality heads as each model's prior: (dev rows out of fold, five folds
    each predicted by heads fitted on the other four; test rows by heads fitted on every dev row),
    as ``triage eval --router`` fits them (its learners, chosen the same way); ``x``: the dev and
    test rows' embeddings."""
    from classifiers.training.model_labels import folds
    from classifiers.training.router_training import fit_router
    from eval.router_run import FOLDS, out_of_fold

    policy, vm, _ = routed(policy_path, router)
    fit = fit_router(policy, router, vm, dev.labels, x[0])
    oof, _, _ = out_of_fold(router, vm, dev.labels, x[0], dev.cost, folds(dev.labels.ids, FOLDS), vm.learners)
    return oof, fit.head.proba(x[1])
