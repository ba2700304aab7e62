"""``python -m benchmarks semantic-cache``: the semantic cache's hit rule fitted to false-hit
budgets on the intent sets' tuning rows and measured on their test rows (:mod:`eval.cache_fit`),
and the lookup's latency (``SemanticIndex.nearest`` + ``Rule.accepts``) at 1k, 10k and 100k entries."""

from __future__ import annotations

import json
import time
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.meters import cpu_kind
from classifiers.training.train_all import embedding_cache
from eval.cache_fit import report, streams
from policies.loader import load
from policies.semantic_cache import Rule, SemanticIndex


def latency(sizes: tuple[int, ...] = (1_000, 10_000, 100_000), lookups: int = 400, dim: int = 384) -> dict[str, object]:
    rng = np.random.default_rng(0)
    rule = Rule("vote", 0.85, 0.02, 6)
    out: dict[str, object] = {}
    for size in sizes:
        centres = rng.standard_normal((max(1, size // 100), dim)).astype(np.float32)
        x = centres[rng.integers(0, len(centres), size)] + 0.5 * rng.standard_normal((size, dim)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        index = SemanticIndex(dim, size)
        for i, v in enumerate(x):
            index.add(v, i % 500)
        q = x[rng.integers(0, size, lookups)] + 0.1 * rng.standard_normal((lookups, dim)).astype(np.float32)
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        times = []
        for v in q:
            t = time.perf_counter()
            n = index.nearest(v)
            rule.accepts(n) if n is not None else None
            times.append(time.perf_counter() - t)
        us = np.array(times) * 1e6
        out[str(size)] = {
            "p50_us": round(float(np.percentile(us, 50)), 1),
            "p99_us": round(float(np.percentile(us, 99)), 1),
        }
        print(f"lookup at {size:>7} entries: p50 {np.percentile(us, 50):8.1f} us  p99 {np.percentile(us, 99):8.1f} us")
    return out


def table(rows: list[dict]) -> None:  # type: ignore[type-arg]
    print(
        f"{'conf':>5} {'budget':>6} | {'global: hit  fhr':>17} | {'rule':>6}: {'hit':>6} {'fhr':>6} "
        "| same-fhr global: hit   fhr | ratio"
    )
    for r in rows:
        g, b = r["test"]["global"]["all"], r["test"][r["best"]]["all"]
        s = r["global_at_same_rate"]["test"]
        print(
            f"{r['confidence']:>5} {r['budget']:>6} | {g['hit_rate']:>8.4f} {g['false_hit_rate']:>8.4f} | "
            f"{r['best']:>6}: {b['hit_rate']:.4f} {b['false_hit_rate']:.4f} | "
            f"{s['hit_rate']:>15.4f} {s['false_hit_rate']:.4f} | {r['ratio']:.1f}"
        )


def run(policy: Path, data: Path, budgets: list[float], threads: int, out: Path) -> None:
    cfg = load(policy).classifier
    assert cfg is not None, "the policy has no classifier (no encoder)"
    cache = embedding_cache(cfg, threads, "-semcache")
    try:
        tuning, test = streams(data, cache.embed, "tuning"), streams(data, cache.embed, "test")
    finally:
        cache.save()
    norms = np.linalg.norm(tuning[0].vectors, axis=1)
    print(f"cpu: {cpu_kind()}; embeddings' norms {norms.min():.5f}..{norms.max():.5f}")
    t0 = time.perf_counter()
    rows = report(tuning, test, budgets)
    table(rows)
    doc = {
        "date": date.today().isoformat(),
        "cpu": cpu_kind(),
        "budgets": budgets,
        "fit_seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
        "latency": latency(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
