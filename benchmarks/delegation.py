"""``python -m benchmarks delegation``: does a probe of the *value of escalating* order the cascade's
last escalation better than the scorer's confidence does (issue 31, item 1; Calibrate-Then-Delegate)?

The rows are those ``python -m benchmarks hidden-probe`` scored (its rows cache: the default
scorer's lettered answer, probabilities and final-layer hidden state at the answer position, per
row), on the typed sets whose top tier has recorded answers: MMLU-Pro (gemini-1.5-pro-002, from
``model_labels/mmlu_pro_models``) and MMLU-Redux (GPT-4-1106, from RouteLLM's MMLU recordings),
read as ``triage eval --top`` reads them (:func:`eval.tier_runs.recorded`). On those rows the
cascade's last step is scorer -> top: a question is kept at the scorer or escalated. Each order
escalates first the rows with the highest score:

- ``own``: 1 - the scorer's top probability (its own confidence, ``gate: confidence``'s order);
- ``p_right``: 1 - P(the scorer is right), the hidden-probe bench's (c) probe (hidden state, top
  probability, margin);
- ``p_fix``: P(the top is right and the scorer wrong), the delegation value, the same features;
- ``gain``: P(the top is right) - P(the scorer is right), two probes on the same features;
- ``oracle``: the rows escalating fixes first, then those it does not change, those it breaks last.

Fits on the pooled dev rows (standardised logistic regression, C by 5-fold CV AUROC, as the
hidden-probe bench), figures on the test rows: per order the curve of accuracy against the share
escalated, its APGR, CPT(50%) and CPT(80%) as RouteLLM defines them (``eval/anchors.py``: the mean
share of the gap to the top closed over the shares, no best-so-far envelope; a random order scores
about 0.5), the share
escalated for 97% of always-top accuracy, and standard errors of each APGR's difference from
``own``'s over 1,000 paired resamples of the test rows (the probes are not refitted per resample,
so they understate the fits' own variance).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.hidden_probe import POLICY, scorer_spec
from benchmarks.hidden_probe_scorer import _load_cache, _typed_path
from benchmarks.hidden_probe_stats import Outcome, _features, fit_probe
from benchmarks.meters import cpu_kind
from benchmarks.report import save
from eval import anchors
from eval.tier_outputs import Row, read_jsonl, typed_rows

TOPS = {"mmlu_pro": "gemini-1.5-pro-002", "mmlu_redux": "gpt-4-1106-preview"}
SHARES = np.linspace(0.0, 1.0, 101)
BOOTSTRAP = 1000
TARGET = 0.97


LABELS = {"mmlu_pro": "mmlu_pro_models.jsonl.gz", "mmlu_redux": "routellm_mmlu.jsonl.gz"}


def top_right(data: Path, per_set: int) -> dict[str, bool]:
    """``split:id`` -> whether the set's recorded top model was right (its recording's own flag: an
    answer it gave that could not be read is wrong), for the rows the hidden-probe bench loads
    (``per_set`` a split) of every set in :data:`TOPS`; rows the model has no recording of are left out."""
    out: dict[str, bool] = {}
    for name, model in TOPS.items():
        flags = {
            r["question_id"]: bool(r["correct"][model])
            for _, r in read_jsonl(data / "model_labels" / LABELS[name])
            if r.get("question_id") and model in r["correct"] and r["correct"][model] is not None
        }
        for split in ("dev", "test"):
            rows: list[Row] = typed_rows(_typed_path(data, name), split, cap=per_set)
            out.update({f"{split}:{row.id}": flags[row.id] for row in rows if row.id in flags})
    return out


def curve(score: np.ndarray, local: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Accuracy at each share of :data:`SHARES` escalated, highest ``score`` first (ties by row)."""
    order = np.argsort(-score, kind="stable")
    gain = np.concatenate([[0.0], np.cumsum((top.astype(float) - local.astype(float))[order])])
    n = len(score)
    return (local.sum() + gain[np.round(SHARES * n).astype(int)]) / n


def measures(acc: np.ndarray, local: float, top: float) -> dict[str, float | None]:
    """RouteLLM's APGR, CPT(50%) and CPT(80%) of the curve (:mod:`eval.anchors`, the escalated share
    as the cost axis; None where the top is not the better tier), the share escalated for 97% of the
    top's accuracy, and the accuracy at half escalated."""
    reach = np.flatnonzero(acc >= TARGET * top - 1e-12)
    got = anchors.apgr(SHARES, acc, float(local), float(top))
    return {
        "apgr": None if got is None else float(got),
        "cpt_50": anchors.cpt(SHARES, acc, float(local), float(top), 0.5),
        "cpt_80": anchors.cpt(SHARES, acc, float(local), float(top), 0.8),
        "share_for_97pct_of_top": float(SHARES[reach[0]]) if reach.size else None,
        "accuracy_at_50pct": float(acc[50]),
    }


def _orders(dev: list[Outcome], test: list[Outcome], top: dict[str, bool]) -> dict[str, np.ndarray]:
    """Each order's escalation score on the test rows (higher: escalated sooner), fitted on ``dev``."""
    key = lambda o: f"{o.split}:{o.id}"  # noqa: E731
    y_right = np.array([o.right for o in dev], dtype=int)
    y_top = np.array([top[key(o)] for o in dev], dtype=int)
    x_dev, x_test = _features(dev, True), _features(test, True)
    right, _, _ = fit_probe(x_dev, y_right)
    fix, _, _ = fit_probe(x_dev, y_top * (1 - y_right))
    strong, _, _ = fit_probe(x_dev, y_top)
    p_right = right.predict_proba(x_test)[:, 1]
    local = np.array([o.right for o in test], dtype=int)
    t = np.array([top[key(o)] for o in test], dtype=int)
    return {
        "own": 1 - np.array([max(o.probs) for o in test]),
        "p_right": 1 - p_right,
        "p_fix": fix.predict_proba(x_test)[:, 1],
        "gain": strong.predict_proba(x_test)[:, 1] - p_right,
        "oracle": (t - local).astype(float),
    }


def _bootstrap(orders: dict[str, np.ndarray], local: np.ndarray, top: np.ndarray) -> dict[str, float]:
    """Standard errors of each order's APGR minus ``own``'s, over paired resamples of the test rows."""
    rng = np.random.default_rng(31)
    diffs: dict[str, list[float]] = {k: [] for k in orders if k != "own"}
    for _ in range(BOOTSTRAP):
        idx = rng.integers(0, len(local), len(local))
        lo, tp = local[idx], top[idx]
        base = measures(curve(orders["own"][idx], lo, tp), lo.mean(), tp.mean())["apgr"]
        if base is None:  # a resample where the top is no better: no gap to close
            continue
        for k in diffs:
            got = measures(curve(orders[k][idx], lo, tp), lo.mean(), tp.mean())["apgr"]
            assert got is not None
            diffs[k].append(got - base)
    return {k: float(np.std(v)) for k, v in diffs.items()}


def run(per_set: int, data: Path, rows_cache: Path, out: Path) -> dict[str, Any]:
    console = Console()
    top = top_right(data, per_set)
    _, model, key = scorer_spec()
    done = _load_cache(rows_cache, key)
    outcomes = [o for k, o in sorted(done.items()) if k in top and o.source in TOPS]
    dev = [o for o in outcomes if o.split == "dev"]
    test = [o for o in outcomes if o.split == "test"]
    if not dev or not test:
        raise SystemExit(
            f"no scored rows of {', '.join(TOPS)} in {rows_cache}: run `python -m benchmarks hidden-probe "
            f"--sets mmlu_pro --sets mmlu_redux --per-set {per_set}` first"
        )
    orders = _orders(dev, test, top)
    local = np.array([o.right for o in test], dtype=int)
    t = np.array([top[f"{o.split}:{o.id}"] for o in test], dtype=int)
    result: dict[str, Any] = {
        "cpu": cpu_kind(),
        "policy": str(POLICY),
        "rows_key": key,
        "model": model.name,
        "tops": TOPS,
        "dev_rows": len(dev),
        "test_rows": len(test),
        "pooled": {"scorer_accuracy": float(local.mean()), "top_accuracy": float(t.mean())},
        "orders": {},
        "per_set": {},
    }
    se = _bootstrap(orders, local, t)
    for k, s in orders.items():
        result["orders"][k] = {**measures(curve(s, local, t), local.mean(), t.mean()), "apgr_diff_se": se.get(k)}
    for name in TOPS:
        idx = np.array([o.source == name for o in test])
        lo, tp = local[idx], t[idx]
        result["per_set"][name] = {
            "test_rows": int(idx.sum()),
            "scorer_accuracy": float(lo.mean()),
            "top_accuracy": float(tp.mean()),
            "orders": {k: measures(curve(s[idx], lo, tp), lo.mean(), tp.mean()) for k, s in orders.items()},
        }
    save(console, out, result)
    _print(console, result)
    return result


def _f(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print(console: Console, res: dict[str, Any]) -> None:
    p = res["pooled"]
    t = Table(
        title=f"scorer -> top on {res['test_rows']} test rows (fitted on {res['dev_rows']} dev rows): scorer "
        f"{p['scorer_accuracy']:.3f}, top {p['top_accuracy']:.3f}"
    )
    for col in (
        "order",
        "APGR (SE of minus own)",
        "CPT(50%)",
        "CPT(80%)",
        "escalated for 97% of top",
        "accuracy at 50%",
    ):
        t.add_column(col)
    for k, m in res["orders"].items():
        t.add_row(
            k,
            f"{_f(m['apgr'])} ({_f(m['apgr_diff_se'])})",
            _f(m["cpt_50"]),
            _f(m["cpt_80"]),
            _f(m["share_for_97pct_of_top"]),
            _f(m["accuracy_at_50pct"]),
        )
    console.print(t)
