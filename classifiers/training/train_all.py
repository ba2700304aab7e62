"""Train every head a policy declares, write the artifacts it points to, and measure them.

Heads are fitted on ``dev`` rows (intent tasks: ``train``), temperature-scaled on a hash-held-back
part of them, and measured on ``test`` rows only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from classifiers import datasets, layout
from classifiers.calibration import auroc, ece
from classifiers.guard import FOREIGN_QUANTILE, SIMILARITY_QUANTILE
from classifiers.heads import LinearHead
from classifiers.options import OPTIONS
from classifiers.service import artifacts_dir, data_dir
from classifiers.training.embedding_cache import EmbeddingCache, embedding_cache
from classifiers.training.fit import fit_head, held_back
from classifiers.training.guard_training import (
    REFERENCE_ROWS,
    ProbeResult,
    fit_injection,
    fit_reference,
    probe,
    reference_sample,
)
from classifiers.training.options_training import OptionsFit, SetResult, train_options
from classifiers.training.router_training import Hidden, RouterResult, train_routers
from policies.schema import ClassifierSpec, Policy
from policies.semantic import INJECTION

Progress = Callable[[str], None]
TEST_CAP = 3000  # test rows measured per head: a seeded sample (embedding long prompts costs ~40 ms each)


@dataclass
class SourceResult:
    n: int
    accuracy: float
    predicted: dict[str, int]  # answers by class


@dataclass
class HeadResult:
    name: str
    fit_rows: int
    test_rows: int
    accuracy: float
    ece: float
    ece_uncalibrated: float
    extra: dict[str, float] = field(default_factory=dict)
    by_source: dict[str, SourceResult] = field(default_factory=dict)  # question type: per test set


@dataclass
class TrainReport:
    heads: list[HeadResult]
    ood_threshold: float  # similarity under which a prompt is unfamiliar
    foreign_threshold: float  # share of foreign word pieces over which it is
    probes: list[ProbeResult]  # the guard on the probe sets (--probes: ood_probe*.jsonl) and the test rows
    seconds: float


def _rows(
    name: str, cfg: ClassifierSpec, root: Path, split: str, limit: int | None, shaped: bool = False
) -> datasets.Rows:
    """``shaped``: the question-type head's fit rows with :func:`datasets.shaped_choice` rows."""
    if name == "question_type":
        # test rows: a seeded sample of each typed source, so every source counts
        fit = split == "dev"
        rows = datasets.question_type(root, split, per_source_cap=1200 if fit else 400, shaped=shaped and fit)
    elif name == "category":
        rows = datasets.category(root, split)
    elif name == "reasoning":
        rows = datasets.reasoning(root, split)
    else:
        task = cfg.tasks[name]
        rows = datasets.task(root / task.data, split, task.text_field, task.label_field)
    cap = limit if limit is not None else (None if split != "test" else TEST_CAP)
    return datasets.subsample(rows, cap, f"{name}-{split}") if cap is not None else rows


def _splits(name: str, cfg: ClassifierSpec) -> tuple[str, str]:
    return ("train", "test") if name in cfg.tasks else ("dev", "test")


def train_quality(
    policy: Policy,
    policy_dir: Path,
    threads: int = 2,
    say: Progress = print,
    hidden: Hidden | None = None,
    limit: int | None = None,
) -> list[RouterResult]:
    """The quality heads of the policy's routed models (the learned router), into the heads' folder;
    ``hidden``: the probes' readings, for a routed model with a ``probe`` (its second head); ``limit``:
    at most this many dev and test rows, a seeded sample."""
    assert policy.classifier is not None
    cfg = policy.classifier
    cache = embedding_cache(cfg, threads, "-labels")  # label files' prompts: a cache file of their own
    try:
        root, out = data_dir(cfg, policy_dir), artifacts_dir(cfg, policy_dir)
        return train_routers(policy, root, cache.embed, out, say, hidden, limit)
    finally:
        cache.save()


def train(
    cfg: ClassifierSpec,
    policy_dir: Path,
    threads: int = 2,
    say: Progress = print,
    limit: int | None = None,
    probe_dir: Path | None = None,
) -> TrainReport:
    """Train, calibrate, save and measure every head; ``limit`` caps the rows per head and split
    (for quick runs and tests); the guard is measured on the probe sets of ``probe_dir`` when given
    (a checkout's ``benchmarks/probes``) and on the shared test rows."""
    t0 = time.perf_counter()
    root, out = data_dir(cfg, policy_dir), artifacts_dir(cfg, policy_dir)
    e = cfg.encoder
    cache = embedding_cache(cfg, threads)
    encoder = cache.encoder
    results: list[HeadResult] = []
    refs: list[np.ndarray] = []
    held: list[np.ndarray] = []
    for name in [name for name in [*cfg.heads, *cfg.tasks] if name not in (OPTIONS, INJECTION)]:
        fit_split, test_split = _splits(name, cfg)
        rows = _rows(name, cfg, root, fit_split, limit, shaped=True)
        say(f"{name}: embedding {len(rows)} {fit_split} rows")
        readings = cache.read(rows.texts)
        x = np.stack([r.vector for r in readings])
        shaped = [i.startswith(datasets.SHAPED) for i in rows.ids]  # fitted on, never calibrated on
        if name == "question_type":  # reads the prompt's layout too (classifiers/layout.py)
            fit_x, labels, ids, synthetic = layout.fit_rows(x, rows.texts, rows.labels, rows.ids, shaped)
            head, _ = fit_head(name, fit_x, labels, ids, synthetic=synthetic)
            head.meta["layout"] = layout.NAME
        else:  # unweighted: P(pays) stays a probability
            head, _ = fit_head(name, x, rows.labels, rows.ids, synthetic=shaped)
        task = cfg.tasks.get(name)
        if task is not None and task.out_of_scope in head.classes:
            dev = _rows(name, cfg, root, "dev", limit)
            cut = fit_oos_threshold(head, cache.embed(dev.texts), dev.labels, task.out_of_scope)
            head.meta.update(out_of_scope=task.out_of_scope, oos_threshold=cut)
        head.save(out)
        # the guard's reference: the rows as the data has them (shaped rows only teach the question type)
        real = [not s for s in shaped]
        x, real_labels = x[real], [y for y, r in zip(rows.labels, real, strict=True) if r]
        calib = held_back([i for i, r in zip(rows.ids, real, strict=True) if r], 0.2)
        refs.append(reference_sample(x[~calib], [y for y, c in zip(real_labels, calib, strict=True) if not c]))
        held.append(x[calib])
        test = _rows(name, cfg, root, test_split, limit)
        say(f"{name}: measuring on {len(test)} {test_split} rows")
        sources = [datasets.source_of(i) for i in test.ids] if name == "question_type" else None
        x_test = cache.embed(test.texts)
        x_test = layout.beside(x_test, test.texts) if layout.reads_layout(head.meta) else x_test
        results.append(measure(head, x_test, test.labels, cfg.tasks.get(name), sources))
        cache.save()
    ordinary, ordinary_test = _ordinary(cfg, root, "fit", limit), _ordinary(cfg, root, "test", limit)
    if INJECTION in cfg.heads:
        say("injection: generating router-aimed prompts, embedding them and every head's training prompts")
        fit = fit_injection(cache, ordinary, ordinary_test, limit)
        fit.head.save(out)
        results.append(
            HeadResult(
                INJECTION,
                int(fit.head.meta["fit_rows"]),
                fit.test_rows,
                1.0 - fit.false_flags,
                fit.ece,
                fit.ece_uncalibrated,
                {"false_flags": fit.false_flags, "threshold": float(fit.head.meta["threshold"])},
            )
        )
        cache.save()
    if not refs and INJECTION in cfg.heads:  # the injection head alone: ordinary prompts are the reference
        x, calib = cache.embed(ordinary.texts), held_back(ordinary.ids, 0.2)
        refs.append(x[~calib][:: max(1, int((~calib).sum()) // REFERENCE_ROWS)])
        held.append(x[calib])
    if OPTIONS in cfg.heads:  # the option scorer: its own artifact and its own embedding cache file
        assert cache.path is not None
        options_cache = EmbeddingCache(encoder, cache.path.with_name(f"{cache.path.stem}-options.npz"))
        fitted, measured, _ = train_options(root, out, options_cache, limit=limit, say=say)
        options_cache.save()
        results.extend(option_results(fitted, measured))
        if not refs:  # only the option head: its questions are the familiarity reference
            refs.append(fitted.fitted[:: max(1, len(fitted.fitted) // REFERENCE_ROWS)])
            held.append(fitted.held)
    calib = held_back(ordinary.ids, 0.2)
    foreign = [encoder.encode(t).foreign for t, c in zip(ordinary.texts, calib, strict=True) if c]
    reference = fit_reference(np.vstack(refs), np.vstack(held), np.array(foreign), e.layers)
    reference.save(
        out, {"rows": len(reference.vectors), "quantile": SIMILARITY_QUANTILE, "foreign_quantile": FOREIGN_QUANTILE}
    )
    cache.save()
    category = LinearHead.load(out, "category") if "category" in cfg.heads else None
    injection = LinearHead.load(out, INJECTION) if INJECTION in cfg.heads else None
    probes = probe(cache, reference, category, injection, ordinary_test, probe_dir)
    cache.save()
    return TrainReport(results, reference.threshold, reference.foreign_threshold, probes, time.perf_counter() - t0)


def _ordinary(cfg: ClassifierSpec, root: Path, which: str, limit: int | None) -> datasets.Rows:
    """Ordinary prompts (the injection head's negatives): every other head's rows of one side."""
    out = datasets.Rows()
    for name in ["question_type", "category", "reasoning", *cfg.tasks]:
        fit_split, test_split = _splits(name, cfg)
        try:
            rows = _rows(name, cfg, root, fit_split if which == "fit" else test_split, limit)
        except FileNotFoundError:
            continue
        for t, i in zip(rows.texts, rows.ids, strict=True):
            out.add(t, "prompt", i)
    return out


def option_results(fitted: OptionsFit, measured: list[SetResult]) -> list[HeadResult]:
    """One row per measured typed set, named ``options/<set>``; chance (and majority for yes_no) as extras."""
    fit_rows = {f.qtype: f.n_fit for f in fitted.fits}
    return [
        HeadResult(
            f"{OPTIONS}/{r.name}",
            fit_rows.get(r.qtype, 0),
            r.n,
            r.accuracy,
            r.ece,
            r.ece_uncalibrated,
            {"chance": r.chance, **({"majority": r.majority} if r.majority is not None else {})},
        )
        for r in measured
    ]


def fit_oos_threshold(head: LinearHead, x: np.ndarray, labels: list[str], oos: str) -> float | None:
    """The top-probability cut under which a prompt is out of scope, chosen on rows the head was
    not fitted on for the mean of in-scope accuracy and out-of-scope recall (balanced accuracy).

    That mean is flat near its best and noisy (CLINC150's dev rows hold 100 out of scope), so
    its argmax jumps between cuts that are statistically tied: int8 and fp32 embeddings, equally
    good at telling out of scope apart, landed at different trades (pooled test accuracy 0.843
    against 0.871). The cut is the middle one of the cuts within one standard error of the best."""
    is_oos = np.array([y == oos for y in labels])
    if len(labels) == 0 or is_oos.all() or not is_oos.any():
        return None
    probs = head.proba(x)
    top, pred = probs.max(axis=1), probs.argmax(axis=1)
    truth = np.array([head.classes.index(y) if y in head.classes else -1 for y in labels])
    k = head.classes.index(oos)
    cuts = np.unique(np.quantile(top, np.linspace(0.0, 0.5, 51)))
    rates = []
    for cut in cuts:
        label = np.where(top < cut, k, pred)
        rates.append(((label == truth)[~is_oos].mean(), (label == k)[is_oos].mean()))
    r = np.array(rates)
    scores = r.mean(axis=1)
    best_in, best_oos = r[scores.argmax()]
    se = np.sqrt(best_in * (1 - best_in) / (~is_oos).sum() + best_oos * (1 - best_oos) / is_oos.sum()) / 2
    tied = cuts[scores >= scores.max() - se]
    return float(tied[len(tied) // 2])


def measure(
    head: LinearHead, x: np.ndarray, labels: list[str], task: object | None = None, sources: list[str] | None = None
) -> HeadResult:
    """Accuracy and ECE on test rows (and per source, given each row's)."""
    known = [i for i, y in enumerate(labels) if y in head.classes]
    y = np.array([head.classes.index(labels[i]) for i in known])
    probs = head.proba(x[known])
    raw = head.proba(x[known], 1.0)
    pred = head.labels(probs)
    correct = pred == y
    result = HeadResult(
        head.name,
        int(head.meta.get("fit_rows", 0)),
        len(known),
        float(correct.mean()),
        ece(probs.max(1), correct),
        ece(raw.max(1), raw.argmax(1) == y),
    )
    if head.name == "reasoning":
        result.extra["auroc"] = auroc(probs[:, head.classes.index("pays")], y == head.classes.index("pays"))
    oos = getattr(task, "out_of_scope", None)
    if oos and oos in head.classes:
        k = head.classes.index(oos)
        is_oos = y == k
        result.extra["oos_recall"] = float((pred[is_oos] == k).mean()) if is_oos.any() else float("nan")
        in_scope = ~is_oos
        result.extra["in_scope_accuracy"] = float(correct[in_scope].mean())
        # what the cut maximises, and how well out of scope is told apart whatever the cut
        result.extra["balanced"] = (result.extra["oos_recall"] + result.extra["in_scope_accuracy"]) / 2
        result.extra["oos_auroc"] = auroc(1.0 - np.delete(probs, k, axis=1).max(axis=1), is_oos)
    if sources is not None:
        src = np.array([sources[i] for i in known])
        for s in sorted(set(src)):
            m = src == s
            result.by_source[s] = SourceResult(
                int(m.sum()),
                float(correct[m].mean()),
                {c: int((pred[m] == j).sum()) for j, c in enumerate(head.classes) if (pred[m] == j).any()},
            )
    return result
