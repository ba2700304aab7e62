"""Agreement on the typed sets with the local tiers first (issue 56, item 1): at the cascade's
scorer -> top step, is the scorer's answer better judged by the votes of the encoder and the scorer
(``agreement``, the scorer's own log-probabilities beside its vote) than by the shipped learned gate
or the scorer's own top probability?

The sets are those whose top tier has recorded answers (MMLU-Pro: gemini-1.5-pro-002; MMLU-Redux:
GPT-4-1106, as ``triage eval --top`` reads them). Everything runs through ``triage eval``'s own code:
the rows and the tiers' cached answers (``gateway.cli.evaluate._prepare``, the cache in ``--out``),
the fit on dev rows (``eval.cascade_report.fit``: temperatures, the learned gates' read-back, each
tier's accuracy and the agreement's numbers, thresholds for 97% of always-top), and per test row each
way's confidence in the answer it would keep (``eval.cascade_eval``: ``judge_p``, the reading's top
probability, ``gate_confidence`` through the votes). Each way escalates its least sure first;
reported: the kept answers' accuracy, the confidence's right/wrong AUROC, RouteLLM's APGR of the
scorer -> top curve (``eval/anchors.py``; its weak end is each way's own kept answers, which the
votes can change: compare the ways by the share escalated, on one scale) and the least share
escalated for 97% of the top. Ties in a confidence escalate in row order.

The learned gates must be trained on the same sets first (``triage train --policy P --cascade-data
... --cascade-dev-cap N --cascade-out OUT``, which also fills the dev rows' cache). The agreement
variant is the policy with its scorer tier at ``gate: confidence`` and ``agreement`` (written beside
the policy while the run lasts: its relative paths hold)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.console import Console
from sklearn.metrics import roc_auc_score

from benchmarks.meters import cpu_kind
from benchmarks.report import save
from eval import anchors, cascade_eval, cascade_report
from eval.cascade_eval import TierSpec, gate_confidence, judge_p
from eval.tier_outputs import Row

TOPS = ["gemini-1.5-pro-002", "gpt-4-1106-preview"]
SETS = ("mmlu_redux.jsonl", "mmlu_pro.jsonl.gz")
TARGET = 0.97


def _agreeing(policy: Path, own_temper: float) -> Path:
    """The policy with its scorer tier judged by agreement, written beside it."""
    doc = yaml.safe_load(policy.read_text())
    for tier in doc["cascade"]["tiers"]:
        if tier.get("type") == "scorer":
            tier["gate"] = "confidence"
            tier.pop("escalation_margin", None)
            tier["agreement"] = {q: {"own_temper": own_temper} for q in ("choice", "yes_no")}
    path = policy.with_name(f".{policy.stem}-agreement-bench.yaml")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _way(specs: list[TierSpec], test: list[Row], way: str) -> dict[str, Any]:
    conf, right, top_right = [], [], []
    scorer, top = specs[1], specs[-1]
    for row in test:
        reading, answer = scorer.reading(row), top.reading(row)
        if reading is None or answer is None:
            continue
        kept = cascade_eval.voted(specs, 1, row, reading)  # the reading itself where there is no agreement
        if way == "learned":
            c = judge_p(specs, 1, row, reading)
        elif way == "own":
            c = reading.confidence_top
        else:
            c = gate_confidence(specs, 1, row, reading)
        conf.append(-1.0 if c is None else float(c))
        right.append(kept.answer == row.answer)
        top_right.append(answer.answer == row.answer)
    s, r, t = np.array(conf), np.array(right, dtype=float), np.array(top_right, dtype=float)
    order = np.argsort(s, kind="stable")  # the least sure escalated first
    n = len(s)
    gain = np.concatenate([[0.0], np.cumsum((t - r)[order])])
    accuracy = (r.sum() + gain) / n
    shares = np.arange(n + 1) / n
    reach = np.flatnonzero(accuracy >= TARGET * t.mean() - 1e-12)
    return {
        "rows": n,
        "kept_accuracy": float(r.mean()),
        "top_accuracy": float(t.mean()),
        "auroc": float(roc_auc_score(r, s)) if 0 < r.sum() < n else None,
        "apgr": anchors.apgr(shares, accuracy, float(r.mean()), float(t.mean())),
        "share_for_97pct_of_top": float(shares[reach[0]]) if reach.size else None,
    }


def run(policy: Path, data: Path, out_dir: Path, dev_cap: int, test_cap: int, own_temper: float, out: Path) -> None:
    from gateway.cli.evaluate import _prepare

    console = Console(highlight=False, width=160)
    started = time.perf_counter()
    files = [data / "typed" / s for s in SETS]
    agreeing = _agreeing(policy, own_temper)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_kind(), "policy": str(policy), "ways": {}}
    try:
        for way, path in (("learned", policy), ("own", policy), ("agreement", agreeing)):
            run_ = _prepare(console, path, files, out_dir, (TOPS, 0.0), (dev_cap, test_cap), ["encoder", "scorer"])
            cascade_report.fit(run_.specs, run_.rows.dev, 0.0, ("of_top", TARGET), None)
            result["ways"][way] = _way(run_.specs, run_.rows.test, way)
            if way == "agreement":
                result["agreement_fitted"] = {q: dataclasses.asdict(a) for q, a in run_.specs[1].agreement.items()}
    finally:
        agreeing.unlink(missing_ok=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    save(console, out, result)

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    for way, m in result["ways"].items():
        console.print(
            f"{way:>9}: {m['rows']} test rows, kept {m['kept_accuracy']:.3f} (top {m['top_accuracy']:.3f}), "
            f"AUROC {f(m['auroc'])}, APGR {f(m['apgr'])}, escalated for 97% of the top {f(m['share_for_97pct_of_top'])}"
        )
