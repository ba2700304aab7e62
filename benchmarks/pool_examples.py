"""Escalations that teach (issue 56, Inter-Cascade's lever), measured: does a cheap local tier answer
better when shown, as solved examples, the nearest questions the top already answered?

Past = MMLU-Pro's dev rows, each with gemini-1.5-pro's recorded answer (what the cascade's memory
would hold: escalations and shadow checks), keyed by MiniLM's embedding of the prompt
(``policies/memory.py``, as served). A seeded sample of test rows is asked of the local lettered
scorer (the tier of ``policies/examples/cascade.yaml``: Qwen2.5-Coder-1.5B, through
``eval/tier_runs.scorer``, the gateway's prompts) twice: as it is, and with the up to ``k`` nearest
dev questions above ``min_similarity`` before it (``policies.memory.with_examples``, as a tier with
``examples: true`` is asked). Reported: each one's accuracy and agreement with gemini-pro on the
same rows, the paired difference with its standard error, and the seconds a question.

``python -m benchmarks pool-examples --rows 150``; a JSON report in ``out/``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from benchmarks.pool_data import Recorded, mmlu_pro, routed
from benchmarks.report import save
from eval.tier_outputs import Row
from eval.tier_runs import scorer
from policies.cascade import Question, read
from policies.loader import load
from policies.memory import Memory, with_examples
from policies.tiers import ScorerTier

TOP = "gemini-1.5-pro-002"


def _memory(dev: Recorded, vectors: np.ndarray, top: int) -> Memory:
    m = Memory(len(dev.gold))
    for i, opts in enumerate(dev.options):
        if dev.answers[i, top] >= 0:
            m.add(vectors[i], Question("choice", dev.labels.texts[i], opts), opts[dev.answers[i, top]])
    return m


def _paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    d = b - a
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")


def run(
    cascade_policy: Path,
    router_policy: Path,
    router: str,
    rows: int,
    k: int,
    min_similarity: float,
    out: Path,
    threads: int | None = None,
) -> dict[str, Any]:
    console = Console(highlight=False)
    started = time.perf_counter()
    data = mmlu_pro(router_policy, router)
    dev, test = data.split("dev"), data.split("test")
    top = data.models.index(TOP)
    pick = np.sort(np.random.default_rng(56).choice(len(test.gold), min(rows, len(test.gold)), replace=False))
    from gateway.cli.router import _embedder

    pol, _, _ = routed(router_policy, router)
    cache = _embedder(pol, 2)
    try:
        dev_vec = cache.embed(dev.labels.texts)
        test_vec = cache.embed([test.labels.texts[i] for i in pick])
    finally:
        cache.save()
    memory = _memory(dev, dev_vec, top)
    policy = load(cascade_policy)
    assert policy.cascade is not None
    tier = next(t for t in policy.cascade.tiers if isinstance(t, ScorerTier))
    if threads is not None:  # the scorer's threads for this run (the policy's are for a shared machine)
        backend = policy.backends[tier.backend].model_copy(update={"n_threads": threads})
        policy = policy.model_copy(update={"backends": {**policy.backends, tier.backend: backend}})
    compute = scorer(policy, tier)
    plain_ok, shown_ok, plain_top, shown_top, shown_n, nearest = [], [], [], [], [], []
    seconds = {"plain": 0.0, "examples": 0.0}
    for n, i in enumerate(pick):
        opts = test.options[i]
        q = Question("choice", test.labels.texts[i], opts)
        gold = opts[test.gold[i]]
        top_said = opts[test.answers[i, top]] if test.answers[i, top] >= 0 else None
        found = memory.nearest(test_vec[n], q, k, min_similarity)
        answers = {}
        for kind, asked in (("plain", q), ("examples", with_examples(q, found))):
            t0 = time.perf_counter()
            got = compute(Row(f"t{i}-{kind}", "mmlu_pro", "test", asked, gold, None))
            seconds[kind] += time.perf_counter() - t0
            answers[kind] = read(asked, _gate(tier), got).answer if got.scores is not None else None
        plain_ok.append(answers["plain"] == gold)
        shown_ok.append(answers["examples"] == gold)
        plain_top.append(answers["plain"] == top_said)
        shown_top.append(answers["examples"] == top_said)
        shown_n.append(len(found))
        nearest.append(found[0].similarity if found else float("nan"))
        if (n + 1) % 25 == 0:
            console.print(
                f"  {n + 1}/{len(pick)}: plain {np.mean(plain_ok):.3f}, with examples {np.mean(shown_ok):.3f}"
            )
    p_ok, s_ok = np.array(plain_ok, float), np.array(shown_ok, float)
    diff, se = _paired(p_ok, s_ok)
    near = np.array(nearest)
    close = near >= 0.8
    report = {
        "rows": len(pick),
        "k": k,
        "min_similarity": min_similarity,
        "plain_accuracy": float(p_ok.mean()),
        "examples_accuracy": float(s_ok.mean()),
        "difference": diff,
        "difference_se": se,
        "plain_agrees_with_top": float(np.mean(plain_top)),
        "examples_agrees_with_top": float(np.mean(shown_top)),
        "top_accuracy": float(np.mean([test.answers[i, top] == test.gold[i] for i in pick])),
        "examples_per_question": float(np.mean(shown_n)),
        "nearest_similarity_median": float(np.nanmedian(near)) if np.isfinite(near).any() else None,
        "rows_nearest_at_least_0.8": int(close.sum()),
        "difference_nearest_at_least_0.8": _paired(p_ok[close], s_ok[close])[0] if close.sum() > 1 else None,
        "seconds_per_question": {kk: v / len(pick) for kk, v in seconds.items()},
        "seconds": round(time.perf_counter() - started, 1),
        "scorer_threads": threads,
    }
    console.print(
        f"{report['rows']} MMLU-Pro test rows, the lettered 1.5B scorer: plain {report['plain_accuracy']:.3f}, with "
        f"up to {k} examples {report['examples_accuracy']:.3f} (paired difference {diff:+.3f}, SE {se:.3f}); "
        f"agreeing with gemini-pro {report['plain_agrees_with_top']:.3f} -> {report['examples_agrees_with_top']:.3f}; "
        f"{report['examples_per_question']:.2f} examples a question, nearest median "
        f"{report['nearest_similarity_median']}; s a question {report['seconds_per_question']}"
    )
    save(console, out, report)
    return report


def _gate(tier: ScorerTier) -> Any:
    from policies.cascade import Gate

    return Gate(tier.name, tier.type, temperatures=dict(tier.temperature))
