"""``python -m benchmarks hidden-probe``: does a linear probe on the scorer's own hidden state
tell its right answers from its wrong ones better than its confidence does (issue 31)?

The scorer tier of the embedded default (``policies/examples/default.yaml``: the ``scorer``
backend's GGUF package, context and batch) answers each row by lettered scoring exactly as the
gateway does (``backends.lettered.ChatScorer.score_question``: the options lettered in the chat
template, one prefill, the next token's distribution over the labels); its answer is the top
option, right when that option's text is the row's answer. The same prefill also gives the
model's final-layer hidden state (after the output norm, before the LM head) at the answer
position: llama.cpp's context is switched to embedding mode (``llama_set_embeddings``) with no
pooling, so one decode returns both the logits and the per-token hidden state; the logits are
those of the plain pass up to float rounding (checked on every 20th row: the answer and the largest
probability difference of a second pass with embedding mode off, and the time of both; with no
pooling llama.cpp computes every prompt token's logits, which the timings include).

Rows: ``eval.tier_outputs.typed_rows`` of the shared typed sets (``../shared/data/typed``), the
``dev`` and the ``test`` split of each set, each capped at ``--per-set`` by the loader's seeded
hash of the id (the same rows on every machine); numeric questions and prompts longer than the
context are skipped and counted. Fits on the pooled dev rows only, figures on the test rows only:

- (a) the scorer's own confidence, its top option's probability (no fit); also on the gate's
  scale (``policies.cascade.confidence``: for yes/no the margin), which the docs' 0.693 used;
- (b) a logistic-regression probe on the standardised hidden state, C from {0.01, 0.1, 1} by
  5-fold cross-validated AUROC on the dev rows;
- (c) the same with the top probability and the top-two margin added as features;
- (set) the row's set's dev accuracy alone: how much of a pooled AUROC knowing the set gives.

With ``--layers`` (issue 31's follow-up: the literature reads middle layers, which llama.cpp does
not return), the context is built again with llama.cpp's graph-evaluation callback (``cb_eval``),
which copies the last position's column of each requested ``l_out-<il>`` tensor (the residual
stream after transformer layer ``il``) out of the same decode; a row already in the cache is scored
once more, as the gateway does (embedding mode off), for those states only, its answer checked
against the cached one. Fits (dev rows) and figures (test rows) as for (b), per layer, and one on
the requested layers' states concatenated with the top probability and margin.

AUROC of P(right) pooled and per set, 95% intervals of the pooled ones (and of the differences
against (a)) from 1,000 bootstrap resamples of the test rows, ECE of (c)'s probability (10 bins).
The project's learned gate (0.774 in docs/benchmarks.md) was measured in another run on other
rows: not comparable row for row. Every row's outcome (with its hidden state) is kept in a JSONL
beside the report, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import os
import platform
import time
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from backends import gguf
from backends.lettered import PROMPT_VERSION, LetteredInputError
from backends.logprob import PromptTooLong
from benchmarks.hidden_probe_scorer import (
    LayerStates,
    ProbedScorer,
    _b64,
    _load_cache,
    _load_layers,
    _typed_path,
    layer_row,
    score_row,
)
from benchmarks.hidden_probe_stats import (
    BOOTSTRAP,
    CS,
    FOLDS,
    Outcome,
    _auroc,
    _bootstrap,
    _ece,
    _features,
    _margin,
    fit_probe,
)
from benchmarks.meters import cpu_kind
from benchmarks.report import save
from eval.tier_outputs import Row, typed_rows
from policies.cascade import confidence
from policies.loader import load
from policies.schema import GGUFScorerBackendSpec

SETS = ("mmlu_pro", "mmlu_redux", "commonsenseqa", "openbookqa", "piqa", "boolq")
POLICY = Path("policies/examples/default.yaml")
CHECK_EVERY = 20  # every 20th row is also scored with embedding mode off
GATE_AUROC = 0.774  # docs/benchmarks.md, 2026-12-03: the learned gate, another run on other rows
GOAL = 0.80


def scorer_spec() -> tuple[GGUFScorerBackendSpec, Path, str]:
    """The default policy's scorer, its GGUF file, and the key its rows are cached under."""
    spec = load(POLICY).backends["scorer"]
    assert isinstance(spec, GGUFScorerBackendSpec), "the default policy's scorer is a gguf_scorer"
    path = gguf.model_file(spec.gguf.package, spec.gguf.path)
    return spec, path, f"{path.name}:{PROMPT_VERSION}:{spec.n_ctx}"


def run(
    per_set: int, sets: tuple[str, ...], threads: int, data: Path, out: Path, layers: tuple[int, ...] = ()
) -> dict[str, Any]:
    from benchmarks.hidden_probe_report import _print  # the report imports this module's constants

    console = Console()
    spec, path, key = scorer_spec()
    n_ctx, n_batch = spec.n_ctx, spec.n_batch

    rows: list[Row] = []
    set_of: dict[str, str] = {}  # split:id -> the set
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for name in sets:
        p = _typed_path(data, name)
        counts[name] = {}
        for split in ("dev", "test"):
            got = typed_rows(p, split, cap=per_set)
            numeric = sum(1 for r in got if r.question.numeric)
            rows += [r for r in got if not r.question.numeric]
            set_of.update({f"{r.split}:{r.id}": name for r in got})
            counts[name][split] = {"loaded": len(got), "numeric_skipped": numeric, "too_long": 0, "input_error": 0}

    cache = out.with_suffix(".rows.jsonl")
    cache.parent.mkdir(parents=True, exist_ok=True)
    done = _load_cache(cache, key)
    layer_cache = out.with_suffix(".layers.jsonl")
    lay = _load_layers(layer_cache, key) if layers else {}

    def missing(r: Row) -> bool:
        k = f"{r.split}:{r.id}"
        return k not in done or (
            bool(layers) and not set(layers) <= set(lay.get(k, LayerStates({}, 0, True, 0)).states)
        )

    todo = [r for r in rows if missing(r)]
    console.print(
        f"{len(rows)} rows ({len(done)} from {cache}"
        + (f"; layers {list(layers)}: {len(rows) - len(todo)} rows complete in {layer_cache}" if layers else "")
        + f"), model {path.name}, {threads} thread(s)"
    )
    skipped: dict[str, str] = {}
    n_layer: int | None = None
    t_start = time.perf_counter()
    if todo:
        scorer = ProbedScorer(path, n_ctx, threads, n_batch, layers)
        n_layer = scorer.n_layer
        if layers:
            console.print(f"the model has {scorer.n_layer} layers; tapping l_out-{', l_out-'.join(map(str, layers))}")
        try:
            with cache.open("a") as f, layer_cache.open("a") if layers else open(os.devnull, "w") as fl:
                for i, row in enumerate(todo, 1):
                    k = f"{row.split}:{row.id}"
                    try:
                        if k in done:  # only the layers' states are new
                            ls = layer_row(scorer, row, done[k])
                        else:
                            scorer.embedding_mode(True)
                            o = score_row(scorer, row, check=i % CHECK_EVERY == 1)
                            done[k] = o
                            f.write(json.dumps({"key": key, **o.to_json()}) + "\n")
                            f.flush()
                            ls = LayerStates(scorer.layer_states(), o.seconds, True, 0.0) if layers else None
                    except (PromptTooLong, LetteredInputError) as exc:
                        skipped[k] = type(exc).__name__
                        if scorer.tap is not None:
                            scorer.tap.got, scorer.tap.error = {}, None
                        continue
                    if ls is not None:
                        lay[k] = ls
                        doc = {"key": key, "split": row.split, "id": row.id, **ls.__dict__}
                        doc["layers"] = {str(il): _b64(v) for il, v in doc.pop("states").items()}
                        fl.write(json.dumps(doc) + "\n")
                        fl.flush()
                    if i % 50 == 0 or i == len(todo):
                        el = time.perf_counter() - t_start
                        console.print(f"  {i}/{len(todo)} rows, {el / i:.2f} s a row, {el / 60:.1f} min")
        finally:
            scorer.close()
    run_s = time.perf_counter() - t_start
    for k, why in skipped.items():
        counts[set_of[k]][k.split(":", 1)[0]]["too_long" if why == "PromptTooLong" else "input_error"] += 1

    outcomes = [done[f"{r.split}:{r.id}"] for r in rows if f"{r.split}:{r.id}" in done]
    if layers:  # every figure on the rows with every requested layer's state: the same rows for all
        outcomes = [
            o for o in outcomes if set(layers) <= set(lay.get(f"{o.split}:{o.id}", LayerStates({}, 0, True, 0)).states)
        ]
    dev = [o for o in outcomes if o.split == "dev"]
    test = [o for o in outcomes if o.split == "test"]
    y_dev = np.array([o.right for o in dev], dtype=int)
    y_test = np.array([o.right for o in test], dtype=int)

    t_fit = time.perf_counter()
    probe_b, c_b, cv_b = fit_probe(_features(dev, False), y_dev)
    probe_c, c_c, cv_c = fit_probe(_features(dev, True), y_dev)
    fit_s = time.perf_counter() - t_fit
    dev_acc = {
        n: float(np.mean([float(o.right) for o in dev if set_of[f"{o.split}:{o.id}"] == n] or [0.0])) for n in sets
    }
    scores = {
        "a_top_prob": np.array([max(o.probs) for o in test]),
        "a_gate_scale": np.array([confidence(o.qtype, o.probs) for o in test]),
        "b_hidden_probe": probe_b.predict_proba(_features(test, False))[:, 1],
        "c_probe_plus_conf": probe_c.predict_proba(_features(test, True))[:, 1],
        "set_dev_accuracy": np.array([dev_acc[set_of[f"{o.split}:{o.id}"]] for o in test]),
    }
    fits: dict[str, Any] = {
        "b_hidden_probe": {"C": c_b, "cv_auroc": cv_b},
        "c_probe_plus_conf": {"C": c_c, "cv_auroc": cv_c},
    }
    if layers:
        t_fit = time.perf_counter()

        def states(part: list[Outcome], il: int) -> np.ndarray:
            return np.stack([lay[f"{o.split}:{o.id}"].states[il] for o in part]).astype(np.float64)

        def concat(part: list[Outcome]) -> np.ndarray:
            conf = np.array([[max(o.probs), _margin(o.probs)] for o in part])
            return np.hstack([states(part, il) for il in layers] + [conf])

        for il in layers:
            probe, c, cv = fit_probe(states(dev, il), y_dev)
            scores[f"layer_{il}_probe"] = probe.predict_proba(states(test, il))[:, 1]
            fits[f"layer_{il}_probe"] = {"C": c, "cv_auroc": cv}
        probe, c, cv = fit_probe(concat(dev), y_dev)
        scores["layers_concat_plus_conf"] = probe.predict_proba(concat(test))[:, 1]
        fits["layers_concat_plus_conf"] = {"C": c, "cv_auroc": cv}
        fit_s += time.perf_counter() - t_fit
    pooled = {k: _auroc(s, y_test) for k, s in scores.items()}
    intervals = _bootstrap(scores, y_test, "a_top_prob")
    by_set: dict[str, Any] = {}
    for n in sets:
        idx = np.array([set_of[f"{o.split}:{o.id}"] == n for o in test])
        if not idx.any():
            continue
        by_set[n] = {
            "test_rows": int(idx.sum()),
            "dev_rows": sum(1 for o in dev if set_of[f"{o.split}:{o.id}"] == n),
            "accuracy": float(y_test[idx].mean()),
            "dev_accuracy": dev_acc[n],
            "auroc": {k: _auroc(s[idx], y_test[idx]) for k, s in scores.items() if k != "set_dev_accuracy"},
        }
    checks = [o.check for o in outcomes if o.check]
    secs = np.array([o.seconds for o in outcomes])
    result: dict[str, Any] = {
        "date": date.today().isoformat(),
        "cpu": cpu_kind(),
        "versions": _versions(),
        "settings": {
            "per_set": {"dev": per_set, "test": per_set},
            "sets": list(sets),
            "threads": threads,
            "model": path.name,
            "package": spec.gguf.package,
            "n_ctx": n_ctx,
            "n_batch": n_batch,
            "prompt_version": PROMPT_VERSION,
            "hidden_size": int(outcomes[0].hidden.size) if outcomes else None,
            "cs": list(CS),
            "folds": FOLDS,
            "bootstrap": BOOTSTRAP,
            "check_every": CHECK_EVERY,
            "layers": list(layers),
            "n_layer": n_layer,
        },
        "rows": {
            "counts": counts,
            "dev_used": len(dev),
            "test_used": len(test),
            "skipped": len(skipped),
            "test_share_right": float(y_test.mean()) if len(test) else None,
            "dev_share_right": float(y_dev.mean()) if len(dev) else None,
        },
        "timings": {
            "rows_scored_this_run": len(todo) - len(skipped),
            "run_s": run_s,
            "seconds_per_row_mean": float(secs.mean()),
            "seconds_per_row_p50": float(np.median(secs)),
            "seconds_per_row_p90": float(np.percentile(secs, 90)),
            "fit_s": fit_s,
        },
        "one_pass_check": {
            "rows": len(checks),
            "same_answer": float(np.mean([c["same_answer"] for c in checks])) if checks else None,
            "max_abs_prob_diff": float(max(c["max_abs_prob_diff"] for c in checks)) if checks else None,
            "seconds_plain_mean": float(np.mean([c["seconds_plain"] for c in checks])) if checks else None,
            "seconds_embedding_mean": float(np.mean([o.seconds for o in outcomes if o.check])) if checks else None,
        },
        "layer_pass": _layer_pass([lay[f"{o.split}:{o.id}"] for o in outcomes]) if layers else None,
        "fits": fits,
        "test": {
            "pooled_auroc": pooled,
            "pooled_interval_95": intervals,
            "ece_c": _ece(scores["c_probe_plus_conf"], y_test),
            "ece_b": _ece(scores["b_hidden_probe"], y_test),
            "ece_a_top_prob": _ece(scores["a_top_prob"], y_test),
            "per_set": by_set,
        },
        "notes": [
            "fits on the dev rows only; every figure on the test rows only",
            f"the project's learned gate's {GATE_AUROC} (docs/benchmarks.md) is from another run on other rows "
            "(11 typed sets, the cascade's eval): not comparable row for row",
            "set_dev_accuracy: each test row scored by its set's dev accuracy, the part of a pooled AUROC "
            "that knowing the set alone gives",
            "hidden state: the final layer after the output norm, at the answer position, from the same "
            "decode as the answer's logits",
            "layer_<il>_probe: the same probe as (b) on the residual stream after transformer layer il "
            "(llama.cpp's l_out-<il>, before any norm) at the answer position, read by llama.cpp's "
            "graph-evaluation callback; for rows already cached, from a second pass with embedding mode off "
            "whose answer is checked against the cached one (layer_pass)",
            "layers_concat_plus_conf: the requested layers' states concatenated, with the top probability and "
            "the top-two margin",
        ],
    }
    _print(console, result)
    save(console, out, result)
    return result


def _layer_pass(got: list[LayerStates]) -> dict[str, Any]:
    secs = np.array([g.seconds for g in got]) if got else np.zeros(1)
    return {
        "rows": len(got),
        "same_answer": float(np.mean([g.same_answer for g in got])) if got else None,
        "max_abs_prob_diff": float(max(g.max_abs_prob_diff for g in got)) if got else None,
        "seconds_per_row_mean": float(secs.mean()),
        "seconds_per_row_p50": float(np.median(secs)),
    }


def _versions() -> dict[str, str]:
    import llama_cpp
    import sklearn

    return {
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "scikit_learn": sklearn.__version__,
        "numpy": np.__version__,
    }
