"""``python -m benchmarks router-probe``: does a small GGUF model's reading of the prompt help the
learned router see difficulty (issue 31, item 2)?

The router's quality heads read MiniLM's embedding of the prompt. Here the same heads (the same
learners, chosen the same way, :func:`classifiers.training.quality_training.fit_quality`) are fitted
on the dev rows of a routed model's labels file three times, on the same rows:

- ``minilm``: the served features, MiniLM's embedding;
- ``gguf``: a GGUF model's final hidden state over the prompt (llama.cpp's embedding mode, mean
  pooled over the prompt's tokens, one prefill and no generation), L2-normalised: what a routed
  model's ``probe`` serves (:mod:`backends.hidden`);
- ``minilm+gguf``: both, as the probe's head reads them (:func:`classifiers.quality.joint_features`);

then each predicts the test rows and is measured as ``triage eval --router`` measures (APGR, the
strong model's share of calls for 95% of its accuracy, the cost to match the best model; for two
candidates, standard errors from a paired bootstrap of the test rows, of each figure and of its
difference from ``minilm``'s). A fourth
row, ``gated``, takes the probed prediction only where MiniLM's is close (the two best candidates'
predicted P(right) within a margin, chosen on the dev rows out of fold as the margin that probes
half of them), so the probe's prefill is paid on part of the traffic; its share is reported.

Rows: ``--dev`` and ``--test`` rows of the labels file, a seeded sample by SHA-256 of the id (the
same rows on every machine), so that a pass fits in a session; the GGUF features are cached per
model and prompt under ``out/router-probe/`` so an interrupted run resumes. The probe's time per
prompt is measured and priced nowhere: the report gives it in milliseconds beside the CPU kind.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from backends.answer import AnswerCache
from backends.hidden import HiddenCache
from backends.letters import LetterCache, TwoOrderLetterCache
from benchmarks.meters import cpu_kind
from benchmarks.report import save
from classifiers.quality import joint_features
from classifiers.service import data_dir
from classifiers.training.model_labels import LabelSet, folds, group_folds
from classifiers.training.quality_training import fit_quality
from classifiers.training.router_training import labels_for
from eval.router_eval import RouterReport, evaluate, routellm_measures, sweep, versus_best_single
from eval.router_run import FOLDS, input_tokens, out_of_fold
from policies.loader import load
from policies.routed import Rule, candidate_costs, candidate_label, prune
from policies.schema import Policy, RoutedModel

log = logging.getLogger(__name__)
OUT = Path("out/router-probe")
BOOTSTRAP = 200
N_CTX = 1024  # the bench's runs of 2026-12-05 read up to 1,024 tokens
LETTERS_N_CTX = 2048  # as the default policy's scorer


def sample(labels: LabelSet, split: str, n: int) -> LabelSet:
    """At most ``n`` rows of ``split``, a seeded sample (:meth:`LabelSet.sample`)."""
    return labels.split(split).sample(n)


def _fit_predict(
    name: str, vm: RoutedModel, dev: LabelSet, x_dev: np.ndarray, c_dev: np.ndarray, x_test: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None, str]:
    fit = fit_quality(
        name, dev.models, x_dev, dev.correct, dev.ids, learners=vm.learners, categories=dev.categories, cost=c_dev
    )
    return fit.head.proba(x_test), fit.head.dev_accuracy, f"{fit.head.meta['learner']} {fit.head.meta['setting']}"


def _closeness(q: np.ndarray) -> np.ndarray:
    """The gap between the two best candidates' predicted P(right), per row."""
    top = np.sort(np.where(np.isfinite(q), q, -np.inf), axis=1)[:, ::-1]
    return top[:, 0] - top[:, 1]


def _measures(report: RouterReport) -> dict[str, Any]:
    two = report.two_model or {}
    best = versus_best_single(report)
    return {
        "apgr": two.get("apgr"),
        "strong_share_for_95pct": two.get("share_for_95pct_of_strong"),
        "of_strong_at_40pct": two.get("of_strong_at_40pct"),  # the reasoning goal's measure
        "cpt_50": two.get("cpt_50"),
        "cost_to_match_best": best.get("cost_share_to_match"),
        **{k: v for k, v in best.items() if k != "cost_share_to_match"},
    }


def _two_model(q: np.ndarray, cost: np.ndarray, right: np.ndarray, rule: Rule, strongest: int) -> tuple[float, float]:
    """APGR and the strong model's share for 95% of its accuracy on these rows."""
    weak, strong = float(right[:, 1 - strongest].mean()), float(right[:, strongest].mean())
    m = routellm_measures(sweep(q, cost, right, rule, strongest), weak, strong)
    share = m["share_for_95pct_of_strong"]
    return float(m["apgr"] or np.nan), float(np.nan if share is None else share)


def paired_bootstrap(
    predicted: dict[str, np.ndarray],
    cost: np.ndarray,
    correct: np.ndarray,
    rule: Rule,
    strongest: int,
    seed: int = 31,
    base: str = "minilm",
) -> dict[str, dict[str, float]]:
    """Standard errors of each variant's APGR and share for 95%, and of their differences from
    ``base``'s, over resamples of the test rows (the same resample for every variant)."""
    right = np.nan_to_num(np.asarray(correct, dtype=np.float64), nan=0.0)
    c = np.broadcast_to(cost, right.shape)
    rng = np.random.default_rng(seed)
    draws: dict[str, list[tuple[float, float]]] = {k: [] for k in predicted}
    for _ in range(BOOTSTRAP):
        idx = rng.integers(0, len(right), len(right))
        for k, q in predicted.items():
            draws[k].append(_two_model(q[idx], c[idx], right[idx], rule, strongest))
    against = np.array(draws[base])
    out = {}
    for k, d in draws.items():
        a = np.array(d)
        out[k] = {
            "apgr_se": float(np.nanstd(a[:, 0])),
            "share_se": float(np.nanstd(a[:, 1])),
            "apgr_diff_se": float(np.nanstd(a[:, 0] - against[:, 0])),
            "share_diff_se": float(np.nanstd(a[:, 1] - against[:, 1])),
        }
    return out


def run(
    policy_path: Path,
    router: str,
    model: Path,
    n_dev: int,
    n_test: int,
    threads: int,
    out: Path,
    cv_by: str = "row",
    reading: str = "hidden",
) -> None:
    console = Console(highlight=False)
    policy: Policy = load(policy_path)
    vm = policy.virtual_models[router]
    assert isinstance(vm, RoutedModel) and policy.classifier is not None
    labels = labels_for(vm, data_dir(policy.classifier, policy_path.resolve().parent))
    dev, test = sample(labels, "dev", n_dev), sample(labels, "test", n_test)
    cross = not (len(dev) and len(test))  # one split only (GSM8K, BBH): five folds, as `triage eval --router`
    if cross:
        test, dev = (test if len(test) else sample(labels, "dev", n_test)), dev.take(np.zeros(len(dev), dtype=bool))
    protocol = f"{FOLDS}-fold cross-validation" + (", category-disjoint folds" if cv_by == "category" else "")
    protocol = protocol if cross else "dev -> test"
    console.print(f"{router}: {len(dev)} dev and {len(test)} test rows of {len(labels)} ({protocol}); {model.name}")
    from gateway.cli.router import _embedder

    cache = _embedder(policy, threads)
    try:
        m_dev, m_test = (cache.embed(dev.texts) if not cross else None), cache.embed(test.texts)
    finally:
        cache.save()
    gguf: HiddenCache
    if reading in ("letters", "letters2", "answer"):  # the model's own answer's confidence (letters.py, answer.py)
        kind = {"letters": LetterCache, "letters2": TwoOrderLetterCache, "answer": AnswerCache}[reading]
        gguf = kind(model, LETTERS_N_CTX, threads, folder=OUT, say=console.print)
    else:
        gguf = HiddenCache(model, N_CTX, threads, folder=OUT, say=console.print)
    try:
        g_test = gguf(test.texts)
        g_dev = gguf(dev.texts) if not cross else None
    finally:
        gguf.close()
    variants: dict[str, tuple[np.ndarray | None, np.ndarray]] = {"minilm": (m_dev, m_test), "gguf": (g_dev, g_test)}
    if reading == "letters2":  # the one-order reading beside it, on the same rows (its readings kept or made)
        one = LetterCache(model, LETTERS_N_CTX, threads, folder=OUT, say=console.print)
        try:
            o_test, o_dev = one(test.texts), (one(dev.texts) if not cross else None)
        finally:
            one.close()
        variants["gguf one order"] = (o_dev, o_test)
        both_one = None if m_dev is None or o_dev is None else joint_features(m_dev, o_dev)
        variants["minilm+gguf one order"] = (both_one, joint_features(m_test, o_test))
    c_test = candidate_costs(policy, vm, input_tokens(test.texts))
    c_dev = candidate_costs(policy, vm, input_tokens(dev.texts)) if not cross else None
    fold = group_folds(test.categories, FOLDS) if cv_by == "category" else folds(test.ids, FOLDS)

    def predict(x_dev: np.ndarray | None, x_test: np.ndarray) -> tuple[np.ndarray, str]:
        """The test rows' predictions, pruned as served, and the learner(s) chosen."""
        if cross:
            _, chosen, learners = out_of_fold(router, vm, test, x_test, c_test, fold, vm.learners)
            return chosen, ", ".join(sorted(set(learners)))
        assert x_dev is not None and c_dev is not None
        q, acc, learner = _fit_predict(router, vm, dev, x_dev, c_dev, x_test)
        return prune(q, c_test, acc if vm.prune_dominated else None), learner

    base = test if cross else dev  # the rows the measures' dev figures (best single model) come from
    names = [candidate_label(c.model, c.reasoning) for c in vm.candidates]
    rows: dict[str, dict[str, Any]] = {}
    predicted: dict[str, np.ndarray] = {}
    both = (None if m_dev is None or g_dev is None else joint_features(m_dev, g_dev), joint_features(m_test, g_test))
    for variant, (xd, xt) in {**variants, "minilm+gguf": both}.items():
        chosen, learner = predict(xd, xt)
        predicted[variant] = chosen
        report = evaluate(
            router, names, chosen, test.correct, c_test, test.categories, base.correct, base.categories, vm.rule
        )
        rows[variant] = {"learner": learner, **_measures(report)}
        console.print(f"  {variant}: {learner}")
    # gated: the probed prediction where MiniLM's two best are within a margin that probes half of the
    # rows: set on dev rows out of fold, or (cross-validated) on the test rows' own out-of-fold
    # predictions, which are made without their labels
    if cross:
        margin = float(np.quantile(_closeness(predicted["minilm"]), 0.5))
    else:
        assert m_dev is not None and c_dev is not None
        dev_fold = folds(dev.ids, FOLDS)
        q_oof = np.zeros(dev.correct.shape)
        for k in np.unique(dev_fold):
            inside = dev_fold != k
            q_oof[~inside], _, _ = _fit_predict(
                router, vm, dev.take(inside), m_dev[inside], c_dev[inside], m_dev[~inside]
            )
        margin = float(np.quantile(_closeness(q_oof), 0.5))
    probed = _closeness(predicted["minilm"]) <= margin
    gated = np.where(probed[:, None], predicted["minilm+gguf"], predicted["minilm"])
    report = evaluate(
        router, names, gated, test.correct, c_test, test.categories, base.correct, base.categories, vm.rule
    )
    rows["gated"] = {
        "learner": "minilm, minilm+gguf where close",
        "margin": margin,
        "probed_share": float(probed.mean()),
        **_measures(report),
    }
    predicted["gated"] = gated
    if len(names) == 2:
        right_dev = np.nan_to_num(base.correct, nan=0.0).mean(axis=0)
        strongest = int(np.lexsort((np.broadcast_to(c_test, test.correct.shape).mean(axis=0), -right_dev))[0])
        for k, se in paired_bootstrap(predicted, c_test, test.correct, vm.rule, strongest).items():
            rows[k].update(se)
        for two, one in (("gguf", "gguf one order"), ("minilm+gguf", "minilm+gguf one order")):
            if one in predicted:  # letters2: the second order's worth, paired with the one-order reading's
                pair = {two: predicted[two], one: predicted[one]}
                se = paired_bootstrap(pair, c_test, test.correct, vm.rule, strongest, base=one)[two]
                rows[two]["apgr_diff_se_vs_one_order"] = se["apgr_diff_se"]
                rows[two]["share_diff_se_vs_one_order"] = se["share_diff_se"]
    read = [*dev.texts, *test.texts]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_kind(),
        "policy": str(policy_path),
        "router": router,
        "model": model.name,
        "reading": reading,
        "protocol": protocol,
        "dev_rows": len(dev),
        "test_rows": len(test),
        "probe_ms_p50": gguf.ms_p50(read),
        "probe_tokens_mean": gguf.tokens_mean(read),
        "threads": threads,
        "rows": rows,
    }
    save(console, out, result)
    _print(console, result)


def _f(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def _print(console: Console, res: dict[str, Any]) -> None:
    t = Table(
        title=f"{res['router']}: {res['dev_rows']} dev / {res['test_rows']} test rows ({res['protocol']}), "
        f"probe {res['model']} ({res.get('reading', 'hidden')})"
    )
    cols = (
        "features",
        "learner",
        "APGR (SE; of the difference)",
        "strong share for 95% (SE; diff.)",
        "of strong at 40%",
    )
    for col in (*cols, "probed"):
        t.add_column(col)
    for name, r in res["rows"].items():
        t.add_row(
            name,
            r["learner"],
            f"{_f(r['apgr'])} ({_f(r.get('apgr_se'))}; {_f(r.get('apgr_diff_se'))})",
            f"{_f(r['strong_share_for_95pct'])} ({_f(r.get('share_se'))}; {_f(r.get('share_diff_se'))})",
            _f(r.get("of_strong_at_40pct")),
            _f(r.get("probed_share", 1.0 if "gguf" in name else 0.0)),
        )
    console.print(t)
    for two in ("gguf", "minilm+gguf"):
        r, one = res["rows"][two], res["rows"].get(f"{two} one order")
        if one is not None and "apgr_diff_se_vs_one_order" in r:
            console.print(
                f"{two}, two orders against one: APGR {r['apgr'] - one['apgr']:+.3f} "
                f"(SE {r['apgr_diff_se_vs_one_order']:.3f}), strong share for 95% "
                f"{r['strong_share_for_95pct'] - one['strong_share_for_95pct']:+.3f} "
                f"(SE {r['share_diff_se_vs_one_order']:.3f})"
            )
    console.print(
        f"the probe's prefill: {_f(res['probe_ms_p50'])} ms p50 a prompt ({_f(res['probe_tokens_mean'])} tokens on "
        f"average, {res['threads']} threads, {res['cpu']})"
    )
