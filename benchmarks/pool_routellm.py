"""``python -m benchmarks pool --set routellm-mmlu``: RouteLLM's MMLU pair (GPT-4, Mixtral) in the
anchors' terms, with standard errors (issue 56).

The learned router as ``triage eval --router gpt4-or-mixtral`` fits it (quality heads on MiniLM's
embedding, dev rows; the knob swept on the test rows), measured by :mod:`eval.anchors` over the
strong share (RouteLLM's axis: APGR, CPT(50%), CPT(80%)) and in money (GPT-4's cost for 95% and
100% of its accuracy, Mixtral's calls at their price); standard errors from a bootstrap of the test
rows. RouteLLM's records say only whether each model was right (no answer letters, no
probabilities): agreement and cascade routing cannot be measured on them (a cascade's second step
would need Mixtral's answer or its confidence), nor the memory's examples (they need generation).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from benchmarks.meters import cpu_kind
from benchmarks.pool_data import routed
from benchmarks.report import save
from eval import anchors
from eval.router_run import measure
from policies.routed import choose, knob_grid

BOOTSTRAP = 200
ROUTELLM_APGR = 0.603  # arXiv 2406.18665, Table 2: SW ranking, gold MMLU data augmented


def _measures(right: np.ndarray, cost: np.ndarray, strong_share: np.ndarray, idx: np.ndarray) -> dict[str, Any]:
    """``right``/``cost``/``strong_share``: (points, rows), the first point always-weak, the last
    always-strong; measured on the rows ``idx``."""
    acc, c, share = right[:, idx].mean(axis=1), cost[:, idx].mean(axis=1), strong_share[:, idx].mean(axis=1)
    weak_acc, strong_acc = float(right[0, idx].mean()), float(right[-1, idx].mean())
    weak_cost, strong_cost = float(cost[0, idx].mean()), float(cost[-1, idx].mean())
    a = anchors.measure(share, acc, weak_acc, strong_acc, "strong share", c, (strong_acc, strong_cost))
    return {
        "apgr": a.apgr,
        "cpt_50": a.cpt_50,
        "cpt_80": a.cpt_80,
        "strong_share_for_95": anchors.reaching(share, acc, 0.95 * strong_acc),
        "cost_share_for_95": a.share_for_95,
        "cost_share_for_100": a.share_for_100,
        "weak": weak_acc,
        "strong": strong_acc,
        "weak_cost_share": weak_cost / strong_cost,
    }


def run(policy_path: Path, router: str, out: Path) -> dict[str, Any]:
    console = Console(highlight=False)
    started = time.perf_counter()
    from gateway.cli.router import _embedder

    policy, vm, folder = routed(policy_path, router)
    cache = _embedder(policy, 1)
    try:
        result = measure(policy, router, vm, folder, cache.embed)
    finally:
        cache.save()
    right_all = np.nan_to_num(result.labels.correct, nan=0.0)
    costs = np.broadcast_to(result.costs, right_all.shape)
    strong = result.report.models.index(result.report.strongest)
    rows = np.arange(len(right_all))
    knobs = knob_grid(result.quality, result.costs, vm.rule)
    picks = np.array([choose(result.quality, result.costs, vm.rule, float(k)) for k in knobs])
    # always-weak and always-strong close the sweep, as RouteLLM's extreme thresholds do
    picks = np.concatenate([np.full((1, len(rows)), 1 - strong), picks, np.full((1, len(rows)), strong)])
    right, cost = right_all[rows, picks], costs[rows, picks]
    share = (picks == strong).astype(np.float64)
    order = np.argsort(share.mean(axis=1), kind="stable")
    right, cost, share = right[order], cost[order], share[order]
    point = _measures(right, cost, share, rows)
    rng = np.random.default_rng(56)
    draws = [_measures(right, cost, share, rng.integers(0, len(rows), len(rows))) for _ in range(BOOTSTRAP)]
    se = {
        f"{k}_se": float(np.nanstd([np.nan if d[k] is None else d[k] for d in draws]))
        for k in ("apgr", "cpt_50", "cpt_80", "strong_share_for_95", "cost_share_for_95", "cost_share_for_100")
    }
    oracle = result.report.oracle
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_kind(),
        "policy": str(policy_path),
        "router": router,
        "protocol": result.protocol,
        "learner": result.learner,
        "test_rows": len(rows),
        **point,
        **se,
        "apgr_minus_routellm": None if point["apgr"] is None else point["apgr"] - ROUTELLM_APGR,
        "oracle": {"accuracy": oracle.accuracy, "strong_share": oracle.strong_share},
        "seconds": round(time.perf_counter() - started, 1),
    }
    console.print(
        f"RouteLLM MMLU, {len(rows)} test rows ({result.protocol}; {result.learner}): APGR {point['apgr']:.3f} "
        f"(SE {se['apgr_se']:.3f}; RouteLLM's best {ROUTELLM_APGR}), CPT(50%) {point['cpt_50']:.3f}, "
        f"CPT(80%) {point['cpt_80']:.3f}; 95% of GPT-4 at {point['strong_share_for_95']:.3f} GPT-4 calls, "
        f"{point['cost_share_for_95']:.1%} of its cost (SE {se['cost_share_for_95_se']:.1%}; goal <= 30%)"
    )
    save(console, out, doc)
    return doc
