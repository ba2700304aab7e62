"""``python -m benchmarks pool``: a pool of cheaper models against the best single one (issue 56),
on MMLU-Pro's recorded answers of 29 models, priced as the learned router's evaluation prices them.

Fitted on dev rows only (priors, the agreement's tempering and calibration), measured on test rows:
each decision's cost-quality curve (its knob swept) in the anchors' terms (:mod:`eval.anchors`:
APGR and CPT over the cost from the cheapest model's to the strongest's; the cost at 95% and 100% of
the best single model's accuracy, as a share of its cost), with standard errors from a bootstrap of
the test rows (paired: the differences from the router's are resampled together). The levers,
alone and together (:mod:`policies.pool`, :mod:`policies.pool_routing`):

- ``router``: one model per question, the utility rule over the priors (the learned router's rule;
  with ``--heads`` its quality heads as served, pruned), the knob swept;
- ``chain``: a fixed chain chosen on dev rows (two cheap models, then the strongest:
  :func:`pair_chain`), stopped at a confidence threshold (swept): the answer's own prior only
  (``chain``) or the votes of every answer so far (``chain + agreement``);
- ``cascade routing``: the next model chosen by expected gain per cost, stopped by the knob; the
  answer in force only, or the votes (``+ agreement``: both levers);
- ``oracle``: the cheapest right model per row; every single model.

Priors: each model's accuracy on the dev rows (``accuracy``), in the row's category (``category``),
the learned router's quality heads (``heads``: needs the encoder; out of fold on dev rows), or the
memory of escalations (``memory``: the category's, scaled by the nearest past questions' agreement
with the top's answer, :mod:`benchmarks.pool_memory`, which also measures reusing the top's answers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.meters import cpu_kind
from benchmarks.pool_data import Recorded, embeddings, heads_prior, mmlu_pro
from benchmarks.pool_memory import memory_prior, reuse
from benchmarks.report import save
from eval import anchors
from eval.pool_fit import chain, fit_agreement, outcome, priors
from policies.pool import Agreement
from policies.pool_routing import replay
from policies.routed import choose, prune

BOOTSTRAP = 200
KNOBS = tuple(np.geomspace(2.0, 2000.0, 13))  # quality per unit of money (the prices' dollars)
FIT_KNOBS = (30.0, 100.0)  # the agreement's refit reads the states the decision reaches at these
THRESHOLDS = (*np.linspace(0.0, 1.0, 41), 1.01)


@dataclass
class Swept:
    """A decision's points on the test rows: per knob (or threshold), per row."""

    name: str
    right: np.ndarray  # (points, rows)
    cost: np.ndarray
    calls: np.ndarray


def _singles(t: Recorded) -> tuple[np.ndarray, np.ndarray]:
    """Per row, each model right (rows, models) and its cost."""
    return (t.answers == t.gold[:, None]).astype(np.float64), t.cost


def pair_chain(dev: Recorded, strong: int, share: float = 0.1) -> list[int]:
    """A fixed chain for agreement alone (AutoMix's shape), chosen on dev rows: the two models of
    mean cost at most ``share`` of the strongest's whose agreement, taken as the answer where they
    agree (the strongest asked where not), is right most often; then the strongest."""
    right = dev.answers == dev.gold[:, None]
    cost = dev.cost.mean(axis=0)
    cheap = [j for j in range(len(cost)) if cost[j] <= share * cost[strong] and j != strong]
    best, pair = -1.0, (cheap[0], cheap[1])
    for a in cheap:
        for b in cheap:
            if b <= a:
                continue
            agree = (dev.answers[:, a] == dev.answers[:, b]) & (dev.answers[:, a] >= 0)
            acc = float(np.where(agree, right[:, a], right[:, strong]).mean())
            if acc > best:
                best, pair = acc, (a, b)
    first, second = sorted(pair, key=lambda j: (cost[j], -right[:, j].mean()))
    return [first, second, strong]


def sweep_router(name: str, t: Recorded, q: np.ndarray, acc_dev: np.ndarray | None) -> Swept:
    right, cost = _singles(t)
    chosen = prune(q, cost, acc_dev)
    rows = np.arange(len(t.gold))
    picks = [choose(chosen, cost, "utility", float(k)) for k in (0.0, *np.geomspace(1.0, 1e7, 60))]
    return Swept(
        name,
        np.array([right[rows, p] for p in picks]),
        np.array([cost[rows, p] for p in picks]),
        np.ones((len(picks), len(rows))),
    )


def sweep_pool(name: str, t: Recorded, p: np.ndarray, ag: Agreement, combine: bool) -> Swept:
    outs = [outcome(*replay(t.answers, p, t.cost, t.k, ag, k, combine)[:2], t.gold, t.cost) for k in KNOBS]
    return Swept(
        name, np.array([o.right for o in outs]), np.array([o.cost for o in outs]), np.array([o.calls for o in outs])
    )


def sweep_chain(name: str, t: Recorded, p: np.ndarray, order: list[int], ag: Agreement, combine: bool) -> Swept:
    outs = [outcome(*chain(t.answers, p, t.k, order, ag, float(th), combine), t.gold, t.cost) for th in THRESHOLDS]
    return Swept(
        name, np.array([o.right for o in outs]), np.array([o.cost for o in outs]), np.array([o.calls for o in outs])
    )


def held_out(
    dev: Recorded, test: Recorded, p: tuple[np.ndarray, np.ndarray], order: list[int], ag: Agreement, strong: int
) -> dict[str, float | None]:
    """The chain with agreement at the threshold fitted on dev rows (the cheapest whose dev accuracy
    reaches the strongest model's there), then applied to the test rows: what a served knob gives."""
    d = sweep_chain("dev", dev, p[0], order, ag, combine=True)
    target = float((dev.answers[:, strong] == dev.gold).mean())
    acc, cost = d.right.mean(axis=1), d.cost.mean(axis=1)
    ok = np.flatnonzero(acc >= target)
    if not ok.size:
        return {"threshold": None}
    th = float(THRESHOLDS[ok[np.argmin(cost[ok])]])
    o = outcome(*chain(test.answers, p[1], test.k, order, ag, th, True), test.gold, test.cost)
    best = float(test.cost[:, strong].mean())
    return {
        "threshold": th,
        "dev_accuracy": float(acc[ok].max()),
        "test_accuracy": float(o.right.mean()),
        "test_accuracy_se": float(o.right.std() / np.sqrt(len(o.right))),
        "test_strongest_accuracy": float((test.answers[:, strong] == test.gold).mean()),
        "test_cost_share": float(o.cost.mean()) / best,
    }


def oracle(t: Recorded) -> tuple[float, float]:
    right, cost = _singles(t)
    c = np.where(right > 0, cost, np.inf)
    pick = np.where(right.any(axis=1), c.argmin(axis=1), cost.argmin(axis=1))
    rows = np.arange(len(pick))
    return float(right[rows, pick].mean()), float(cost[rows, pick].mean())


def measures(s: Swept, idx: np.ndarray, t: Recorded, ends: tuple[int, int, int]) -> dict[str, float | None]:
    """A curve's measures on the rows ``idx``; ``ends``: the weak (cheapest), strong (strongest on
    dev) and best (most accurate on test) models' columns."""
    right, cost = _singles(t)
    acc, c = s.right[:, idx].mean(axis=1), s.cost[:, idx].mean(axis=1)
    single_acc, single_cost = right[idx].mean(axis=0), cost[idx].mean(axis=0)
    weak, strong, best = ends
    xs = anchors.cost_axis(c, single_cost[weak], single_cost[strong])
    a = anchors.measure(xs, acc, single_acc[weak], single_acc[strong], "cost", c, (single_acc[best], single_cost[best]))
    within = acc[c <= single_cost[best] * (1 + 1e-9)]
    return {
        "apgr": a.apgr,
        "cpt_50": a.cpt_50,
        "cpt_80": a.cpt_80,
        "share_for_95": a.share_for_95,
        "share_for_100": a.share_for_100,
        "accuracy_at_best_cost": float(within.max()) if within.size else None,
        "best_accuracy": float(single_acc[best]),
        "best_cost": float(single_cost[best]),
    }


def bootstrap(curves: list[Swept], t: Recorded, ends: tuple[int, int, int], base: str) -> dict[str, dict[str, float]]:
    """Standard errors of each curve's measures, and of their differences from ``base``'s."""
    rng = np.random.default_rng(56)
    keys = ("apgr", "share_for_95", "share_for_100", "accuracy_at_best_cost")
    draws: dict[str, list[list[float]]] = {s.name: [] for s in curves}
    for _ in range(BOOTSTRAP):
        idx = rng.integers(0, len(t.gold), len(t.gold))
        for s in curves:
            m = measures(s, idx, t, ends)
            draws[s.name].append([np.nan if m[k] is None else float(m[k] or 0.0) for k in keys])
    ref = np.array(draws[base])
    out = {}
    for name, d in draws.items():
        a = np.array(d)
        out[name] = {f"{k}_se": float(np.nanstd(a[:, i])) for i, k in enumerate(keys)}
        out[name] |= {f"{k}_diff_se": float(np.nanstd(a[:, i] - ref[:, i])) for i, k in enumerate(keys)}
    return out


def run(
    policy: Path,
    router: str,
    prior_kinds: list[str],
    out: Path,
    heads: bool,
) -> dict[str, Any]:
    console = Console(highlight=False)
    started = time.perf_counter()
    data = mmlu_pro(policy, router)
    dev, test = data.split("dev"), data.split("test")
    console.print(f"MMLU-Pro: {len(dev.gold)} dev and {len(test.gold)} test rows, {len(data.models)} models")
    dev_right, _ = _singles(dev)
    acc_dev = dev_right.mean(axis=0)
    strong = int(np.lexsort((dev.cost.mean(axis=0), -acc_dev))[0])
    weak = int(test.cost.mean(axis=0).argmin())
    best = int(np.lexsort((test.cost.mean(axis=0), -_singles(test)[0].mean(axis=0)))[0])
    ends = (weak, strong, best)
    order = pair_chain(dev, strong)
    console.print(f"the chain, chosen on dev rows: {' -> '.join(data.models[j] for j in order)}")
    curves: list[Swept] = []
    fitted: dict[str, Any] = {}
    dev_fitted: dict[str, Any] = {}
    sources: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for kind in prior_kinds:
        if kind in ("accuracy", "category"):
            sources[kind] = priors(kind, dev_right, dev.labels.categories, dev.labels.ids, test.labels.categories)
    reused: list[dict[str, Any]] = []
    if heads or "memory" in prior_kinds:
        x = embeddings(policy, router, dev, test)
        if heads:
            sources["heads"] = heads_prior(policy, router, dev, x)
        if "memory" in prior_kinds:
            cat = priors("category", dev_right, dev.labels.categories, dev.labels.ids, test.labels.categories)
            sources["memory"] = memory_prior(dev, test, x, strong, cat)
            reused = reuse(dev, test, x, strong)
    for kind, (p_dev, p_test) in sources.items():
        ag = fit_agreement(dev.answers, p_dev, dev.gold, dev.k, dev.cost, FIT_KNOBS)
        fitted[kind] = ag.to_json()
        console.print(f"prior {kind}: agreement fitted on dev rows {ag}")
        curves.append(sweep_router(f"router ({kind})", test, p_test, acc_dev))
        curves.append(sweep_chain(f"chain ({kind})", test, p_test, order, ag, combine=False))
        curves.append(sweep_chain(f"chain + agreement ({kind})", test, p_test, order, ag, combine=True))
        dev_fitted[kind] = held_out(dev, test, (p_dev, p_test), order, ag, strong)
        curves.append(sweep_pool(f"cascade routing ({kind})", test, p_test, ag, combine=False))
        curves.append(sweep_pool(f"cascade routing + agreement ({kind})", test, p_test, ag, combine=True))
    all_rows = np.arange(len(test.gold))
    base = "router (heads)" if heads else curves[0].name
    se = bootstrap(curves, test, ends, base)
    rows = {s.name: {**measures(s, all_rows, test, ends), **se[s.name]} for s in curves}
    o_acc, o_cost = oracle(test)
    right, cost = _singles(test)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_kind(),
        "policy": str(policy),
        "router": router,
        "dev_rows": len(dev.gold),
        "test_rows": len(test.gold),
        "weak": data.models[weak],
        "strong": data.models[strong],
        "best": data.models[best],
        "chain": [data.models[j] for j in order],
        "agreement": fitted,
        "singles": {
            m: {"accuracy": float(right[:, j].mean()), "cost": float(cost[:, j].mean())}
            for j, m in enumerate(data.models)
        },
        "oracle": {"accuracy": o_acc, "cost": o_cost, "share_of_best_cost": o_cost / float(cost[:, best].mean())},
        "curves": rows,
        "mean_calls_at_100": {s.name: _calls_at(s, test, best) for s in curves},
        "memory_reuse": reused,
        "chain_agreement_dev_fitted": dev_fitted,
        "seconds": round(time.perf_counter() - started, 1),
    }
    _print(console, result, base)
    save(console, out, result)
    return result


def _calls_at(s: Swept, t: Recorded, best: int) -> float | None:
    """The mean calls a question at the cheapest point reaching the best single model's accuracy."""
    right, _ = _singles(t)
    acc, c = s.right.mean(axis=1), s.cost.mean(axis=1)
    ok = np.flatnonzero(acc >= right[:, best].mean())
    return None if not ok.size else float(s.calls[ok[np.argmin(c[ok])]].mean())


def _f(v: Any, fmt: str = ".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and not np.isfinite(v)) else format(v, fmt)


def _print(console: Console, r: dict[str, Any], base: str) -> None:
    console.print(
        f"best single {r['best']}: {r['singles'][r['best']]['accuracy']:.4f} at {r['singles'][r['best']]['cost']:.6f}; "
        f"oracle {r['oracle']['accuracy']:.4f} at {r['oracle']['share_of_best_cost']:.1%} of its cost"
    )
    table = Table(title=f"MMLU-Pro test rows ({r['test_rows']}); SE: bootstrap; diff: against {base}", expand=True)
    for col in (
        "decision",
        "accuracy at the best's cost (SE)",
        "cost for 95% (SE)",
        "cost for 100% (SE; diff)",
        "APGR (SE; diff)",
        "CPT(50%) / CPT(80%)",
        "calls at 100%",
    ):
        table.add_column(col)
    for name, m in r["curves"].items():
        table.add_row(
            name,
            f"{_f(m['accuracy_at_best_cost'], '.4f')} ({_f(m['accuracy_at_best_cost_se'], '.4f')})",
            f"{_f(m['share_for_95'], '.1%')} ({_f(m['share_for_95_se'], '.1%')})",
            f"{_f(m['share_for_100'], '.1%')} ({_f(m['share_for_100_se'], '.1%')}; "
            f"{_f(m['share_for_100_diff_se'], '.1%')})",
            f"{_f(m['apgr'])} ({_f(m['apgr_se'])}; {_f(m['apgr_diff_se'])})",
            f"{_f(m['cpt_50'])} / {_f(m['cpt_80'])}",
            _f(r["mean_calls_at_100"][name], ".2f"),
        )
    console.print(table)
