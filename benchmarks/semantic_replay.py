"""``python -m benchmarks semantic-replay``: the intent sets' test rows through the gateway's own
semantic cache (``gateway.service.cache.semantic.SemanticCache``), with the gateway's grouping.

The fit (:mod:`eval.cache_fit`) groups entries by their intent label. The gateway cannot: it
groups an entry with a kept one whose *answer's* embedding is within ``AGREE`` of its own. Here
each row's answer is what an intent bot would say, ``"intent: LABEL"`` (its label's words), embedded
by the same encoder; a hit is right iff the kept row's label is the new row's. If different
labels' answers merged into one group, or one label's split, the gateway's false-hit rate would
differ from the fit's: this measures that, on the fitted rule, beside the fit's own replay.

CLINC150's out-of-scope rows: the fit gives each its own group and counts any hit on one wrong;
the gateway's answers to them are all "intent: oos", one group, so out-of-scope neighbourhoods
vote as one. Both counts are given (an out-of-scope answer served to an out-of-scope request says
the same thing).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.semantic_cache import cpu_kind
from classifiers.training.train_all import embedding_cache
from eval.cache_fit import OUT_OF_SCOPE, SETS, Replay, read_rows, seeded, streams
from gateway.service.cache.semantic import SemanticCache
from gateway.state.stores import MemoryStore
from policies.loader import load
from policies.schema import SemanticCacheSpec
from policies.semantic_cache import Rule


def run(policy: Path, data: Path, rule: dict[str, float | int | str], threads: int, out: Path) -> dict[str, object]:
    cfg = load(policy).classifier
    assert cfg is not None, "the policy has no classifier (no encoder)"
    cache = embedding_cache(cfg, threads, "-semcache")
    try:
        tests = streams(data, cache.embed, "test")
        answers = {}
        for name in SETS:
            rows = seeded([r for r in read_rows(data, name) if r["split"] == "test"])
            texts = [f"intent: {r['label'].replace('_', ' ')}" for r in rows]
            answers[name] = (rows, cache.embed(texts))
    finally:
        cache.save()
    result: dict[str, object] = {"date": date.today().isoformat(), "cpu": cpu_kind(), "rule": rule, "sets": {}}
    fitted = Rule.from_dict(rule)
    for stream, name in zip(tests, SETS, strict=True):
        rows, answer_vectors = answers[name]
        gw = asyncio.run(_replay(stream.vectors, answer_vectors, rows, rule))
        fit = Replay(stream).run(fitted)
        result["sets"][name] = {  # type: ignore[index]
            "rows": len(rows),
            "gateway": gw,
            "fit": {"hit_rate": round(fit.hit_rate, 4), "false_hit_rate": round(fit.false_hit_rate, 4)},
        }
        print(
            f"{name}: gateway hit rate {gw['hit_rate']:.4f}, false-hit rate {gw['false_hit_rate']:.4f} "
            f"({gw['false_hit_rate_oos_as_one']:.4f} counting out of scope for out of scope as right; groups "
            f"{gw['groups']} for {gw['labels']} labels kept); the fit's replay {fit.hit_rate:.4f} / "
            f"{fit.false_hit_rate:.4f}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


async def _replay(
    questions: np.ndarray, answers: np.ndarray, rows: list[dict[str, str]], rule: dict[str, float | int | str]
) -> dict[str, float | int]:
    async def unused(text: str) -> np.ndarray:
        raise AssertionError("the replay hands in its vectors")

    spec = SemanticCacheSpec(models=["m"], rule=rule, capacity=max(1, len(rows)), audit_share=0)
    cache = SemanticCache(spec, unused, questions.shape[1], "v", MemoryStore())
    label_of: dict[str, str] = {}
    groups: dict[int, set[str]] = {}
    hits = wrong = strict = 0
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        found = cache.find("ctx", questions[i])
        if found is not None:
            hits += 1
            kept = label_of[found.key]
            wrong += kept != row["label"]  # out of scope for out of scope: the same answer
            strict += kept != row["label"] or row["label"] == OUT_OF_SCOPE  # the fit's count
            continue
        key = f"k{i}"
        label_of[key] = row["label"]
        groups.setdefault(cache.add("ctx", questions[i], answers[i], key), set()).add(row["label"])
    return {
        "hit_rate": round(hits / len(rows), 4),
        "false_hit_rate": round(strict / hits, 4) if hits else 0.0,
        "false_hit_rate_oos_as_one": round(wrong / hits, 4) if hits else 0.0,
        "groups": len(groups),
        "labels": len({label for g in groups.values() for label in g}),
        "mixed_groups": sum(len(g) > 1 for g in groups.values()),
        "seconds": round(time.perf_counter() - t0, 1),
    }
