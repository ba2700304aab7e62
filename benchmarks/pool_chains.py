"""Longer chains with agreement (issue 56): every order of up to three of the most accurate cheap
models (at most ``share`` of the strongest's cost), then the strongest, each chain's agreement
fitted on the dev rows' prefix states (``eval/pool_fit.fit_on``) and its threshold at the least dev
cost that reaches the strongest's dev accuracy; ranked by that dev cost, reported on the test rows.
Does a third or fourth opinion lower the cost of matching the best model?

``python -m benchmarks pool-chains``; a JSON report in ``out/``."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from benchmarks.pool import THRESHOLDS
from benchmarks.pool_data import Recorded, mmlu_pro
from benchmarks.report import save
from eval.pool_fit import chain, fit_on, outcome

STRONG = "gemini-1.5-pro-002"


def _fit(dev: Recorded, order: list[int], target: float) -> tuple[Any, np.ndarray, float] | None:
    sub = dev.answers[:, order]
    given = sub >= 0
    p = np.clip(((sub == dev.gold[:, None]) & given).sum(0) + 1.0, 0, None) / (given.sum(0) + 2.0)
    p = np.clip(p, 0.01, 0.99)
    pr = np.tile(p, (len(sub), 1))
    steps = len(order)
    masks = np.concatenate([np.tile(np.arange(steps) <= i, (len(sub), 1)) for i in range(steps)])
    ag = fit_on(masks, np.tile(np.arange(len(sub)), steps), sub, pr, dev.gold, dev.k)
    best: tuple[float, float] | None = None
    for th in THRESHOLDS:
        asked, answer = chain(sub, pr, dev.k, list(range(steps)), ag, float(th))
        o = outcome(asked, answer, dev.gold, dev.cost[:, order])
        if o.right.mean() >= target and (best is None or o.cost.mean() < best[0]):
            best = (float(o.cost.mean()), float(th))
    return None if best is None else (ag, p, best[1])


def run(policy: Path, router: str, cheap_models: int, share: float, out: Path) -> dict[str, Any]:
    console = Console(highlight=False)
    started = time.perf_counter()
    data = mmlu_pro(policy, router)
    dev, test = data.split("dev"), data.split("test")
    acc = (dev.answers == dev.gold[:, None]).mean(axis=0)
    cost = dev.cost.mean(axis=0)
    strong = data.models.index(STRONG)
    cheap = [j for j in range(len(cost)) if cost[j] <= share * cost[strong] and j != strong]
    cheap = sorted(cheap, key=lambda j: -acc[j])[:cheap_models]
    target = float(acc[strong])
    rows = []
    for r in (1, 2, 3):
        for combo in itertools.permutations(cheap, r):
            order = [*combo, strong]
            fitted = _fit(dev, order, target)
            if fitted is None:
                continue
            ag, p, th = fitted
            sub = test.answers[:, order]
            asked, answer = chain(sub, np.tile(p, (len(sub), 1)), test.k, list(range(len(order))), ag, th)
            o = outcome(asked, answer, test.gold, test.cost[:, order])
            dev_asked, dev_answer = chain(
                dev.answers[:, order], np.tile(p, (len(dev.gold), 1)), dev.k, list(range(len(order))), ag, th
            )
            dev_cost = outcome(dev_asked, dev_answer, dev.gold, dev.cost[:, order]).cost.mean()
            rows.append(
                {
                    "chain": [data.models[j] for j in order],
                    "threshold": th,
                    "dev_cost_share": float(dev_cost / cost[strong]),
                    "test_cost_share": float(o.cost.mean() / test.cost[:, strong].mean()),
                    "test_accuracy": float(o.right.mean()),
                    "test_accuracy_se": float(o.right.std() / np.sqrt(len(o.right))),
                }
            )
    rows.sort(key=lambda x: x["dev_cost_share"])
    report = {
        "strongest": STRONG,
        "test_strongest_accuracy": float((test.answers[:, strong] == test.gold).mean()),
        "cheap": [data.models[j] for j in cheap],
        "chains": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    for x in rows[:8]:
        console.print(
            f"dev {x['dev_cost_share']:.1%} -> test {x['test_cost_share']:.1%}, accuracy {x['test_accuracy']:.4f} "
            f"(threshold {x['threshold']:.3f}): {' -> '.join(x['chain'])}"
        )
    console.print(f"{STRONG} alone on the test rows: {report['test_strongest_accuracy']:.4f}")
    save(console, out, report)
    return report
