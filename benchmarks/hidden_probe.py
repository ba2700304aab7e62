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

AUROC of P(right) pooled and per set, 95% intervals of the pooled ones (and of the differences
against (a)) from 1,000 bootstrap resamples of the test rows, ECE of (c)'s probability (10 bins).
The project's learned gate (0.774 in docs/benchmarks.md) was measured in another run on other
rows: not comparable row for row. Every row's outcome (with its hidden state) is kept in a JSONL
beside the report, so an interrupted run resumes.
"""

from __future__ import annotations

import base64
import json
import logging
import platform
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from backends import gguf
from backends.lettered import PROMPT_VERSION, ChatScorer, LetteredInputError
from backends.logprob import PromptTooLong
from benchmarks.meters import cpu_kind
from benchmarks.report import save
from eval.tier_outputs import Row, typed_rows
from policies.cascade import confidence
from policies.loader import load
from policies.schema import GGUFScorerBackendSpec

SETS = ("mmlu_pro", "mmlu_redux", "commonsenseqa", "openbookqa", "piqa", "boolq")
POLICY = Path("policies/examples/default.yaml")
CS = (0.01, 0.1, 1.0)
FOLDS = 5
BOOTSTRAP = 1000
CHECK_EVERY = 20  # every 20th row is also scored with embedding mode off
GATE_AUROC = 0.774  # docs/benchmarks.md, 2026-12-03: the learned gate, another run on other rows
GOAL = 0.80


@dataclass
class Outcome:
    id: str
    source: str
    split: str
    qtype: str
    probs: list[float]
    right: bool
    seconds: float  # the lettered scoring with embedding mode on (the hidden state read)
    hidden: np.ndarray
    check: dict[str, Any] | None = None  # the pass with embedding mode off, on every CHECK_EVERY-th row

    def to_json(self) -> dict[str, Any]:
        doc = {k: v for k, v in self.__dict__.items() if k != "hidden"}
        doc["hidden"] = base64.b64encode(self.hidden.astype(np.float32).tobytes()).decode()
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Outcome:
        hidden = np.frombuffer(base64.b64decode(doc.pop("hidden")), dtype=np.float32).copy()
        return cls(**doc, hidden=hidden)


class ProbedScorer(ChatScorer):
    """The gateway's lettered scorer, whose context can also return the last position's hidden
    state from the same decode (embedding mode, no pooling)."""

    def __init__(self, path: Path, n_ctx: int, n_threads: int, n_batch: int) -> None:
        super().__init__(path, n_ctx, n_threads, n_batch)
        # With no pooling llama.cpp outputs every token of a decode in embedding mode, and says so
        # on each decode (as an error-level line): the cost is in the timings, the line is muted.
        logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)
        if self._lib.llama_pooling_type(self._ctx.ctx) != self._lib.LLAMA_POOLING_TYPE_NONE:
            raise SystemExit("the scorer's context pools its embeddings: no per-token hidden state")
        self.n_embd = int(self._model.n_embd())

    def embedding_mode(self, on: bool) -> None:
        self._lib.llama_set_embeddings(self._ctx.ctx, on)

    def hidden(self) -> np.ndarray:
        """The final-layer hidden state of the last decode's last output (the answer position)."""
        ptr = self._lib.llama_get_embeddings_ith(self._ctx.ctx, -1)
        if not ptr:
            raise RuntimeError("no hidden state: embedding mode was off")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).astype(np.float32)

    def forget_after(self, n: int) -> None:
        """Evaluate everything after the first ``n`` cached tokens again at the next prefill."""
        self._cached = self._cached[:n]


def _typed_path(data: Path, name: str) -> Path:
    for p in (data / "typed" / f"{name}.jsonl", data / "typed" / f"{name}.jsonl.gz"):
        if p.is_file():
            return p
    raise SystemExit(f"no typed set {name} under {data / 'typed'}")


def _probs(logprobs: tuple[float, ...]) -> list[float]:
    v = np.exp(np.array(logprobs, dtype=np.float64))
    return [float(x) for x in v / v.sum()]


def score_row(scorer: ProbedScorer, row: Row, check: bool) -> Outcome:
    q = row.question
    before = None
    if check:  # embedding mode off first, then the same tokens again with it on
        scorer.embedding_mode(False)
        t0 = time.perf_counter()
        plain = scorer.score_question(q)
        before = (time.perf_counter() - t0, _probs(plain.logprobs))
        scorer.forget_after(plain.reused_tokens)
        scorer.embedding_mode(True)
    t0 = time.perf_counter()
    got = scorer.score_question(q)
    hidden = scorer.hidden()
    seconds = time.perf_counter() - t0
    probs = _probs(got.logprobs)
    answer = q.options[int(np.argmax(probs))]
    o = Outcome(row.id, row.source, row.split, q.type, probs, answer == row.answer, seconds, hidden)
    if before is not None:
        plain_s, plain_probs = before
        o.check = {
            "seconds_plain": plain_s,
            "same_answer": int(np.argmax(plain_probs)) == int(np.argmax(probs)),
            "max_abs_prob_diff": float(np.max(np.abs(np.array(plain_probs) - np.array(probs)))),
        }
    return o


def _auroc(score: np.ndarray, right: np.ndarray) -> float | None:
    from sklearn.metrics import roc_auc_score

    if right.min() == right.max():
        return None
    return float(roc_auc_score(right, score))


def _ece(p: np.ndarray, right: np.ndarray, bins: int = 10) -> float:
    edges = np.linspace(0, 1, bins + 1)
    idx = np.clip(np.digitize(p, edges[1:-1], right=True), 0, bins - 1)
    return float(
        sum(
            (idx == b).mean() * abs(p[idx == b].mean() - right[idx == b].mean())
            for b in range(bins)
            if (idx == b).any()
        )
    )


def _margin(probs: list[float]) -> float:
    top = sorted(probs, reverse=True)
    return top[0] - top[1]


def _features(outcomes: list[Outcome], with_conf: bool) -> np.ndarray:
    x = np.stack([o.hidden for o in outcomes]).astype(np.float64)
    if with_conf:
        extra = np.array([[max(o.probs), _margin(o.probs)] for o in outcomes])
        x = np.hstack([x, extra])
    return x


def fit_probe(x_dev: np.ndarray, y_dev: np.ndarray) -> tuple[Any, float, dict[str, float]]:
    """Standardised logistic regression; C by 5-fold CV AUROC on the dev rows; refit on them all."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def model(c: float) -> Any:
        return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=5000))

    folds = StratifiedKFold(FOLDS, shuffle=True, random_state=0)
    cv = {str(c): float(cross_val_score(model(c), x_dev, y_dev, cv=folds, scoring="roc_auc").mean()) for c in CS}
    best = max(CS, key=lambda c: cv[str(c)])
    return model(best).fit(x_dev, y_dev), best, cv


def _bootstrap(scores: dict[str, np.ndarray], right: np.ndarray, base: str) -> dict[str, dict[str, float]]:
    """95% percentile intervals of each pooled AUROC and of its difference from ``base``'s."""
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    draws: dict[str, list[float]] = {k: [] for k in scores}
    diffs: dict[str, list[float]] = {k: [] for k in scores if k != base}
    n = len(right)
    for _ in range(BOOTSTRAP):
        idx = rng.integers(0, n, n)
        y = right[idx]
        if y.min() == y.max():
            continue
        got = {k: float(roc_auc_score(y, s[idx])) for k, s in scores.items()}
        for k, v in got.items():
            draws[k].append(v)
            if k != base:
                diffs[k].append(v - got[base])
    out = {k: {"lo": float(np.percentile(v, 2.5)), "hi": float(np.percentile(v, 97.5))} for k, v in draws.items()}
    for k, d in diffs.items():
        out[k]["diff_vs_" + base] = float(np.mean(d))
        out[k]["diff_lo"] = float(np.percentile(d, 2.5))
        out[k]["diff_hi"] = float(np.percentile(d, 97.5))
    return out


def _load_cache(path: Path, key: str) -> dict[str, Outcome]:
    done: dict[str, Outcome] = {}
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by an interruption
        if doc.pop("key", None) == key and "skipped" not in doc:
            o = Outcome.from_json(doc)
            done[f"{o.split}:{o.id}"] = o
    return done


def run(per_set: int, sets: tuple[str, ...], threads: int, data: Path, out: Path) -> dict[str, Any]:
    console = Console()
    spec = load(POLICY).backends["scorer"]
    assert isinstance(spec, GGUFScorerBackendSpec), "the default policy's scorer is a gguf_scorer"
    path = gguf.model_file(spec.gguf.package, spec.gguf.path)
    n_ctx, n_batch = spec.n_ctx, spec.n_batch
    key = f"{path.name}:{PROMPT_VERSION}:{n_ctx}"

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
    todo = [r for r in rows if f"{r.split}:{r.id}" not in done]
    console.print(f"{len(rows)} rows ({len(done)} from {cache}), model {path.name}, {threads} thread(s)")
    skipped: dict[str, str] = {}
    t_start = time.perf_counter()
    if todo:
        scorer = ProbedScorer(path, n_ctx, threads, n_batch)
        scorer.embedding_mode(True)
        try:
            with cache.open("a") as f:
                for i, row in enumerate(todo, 1):
                    try:
                        o = score_row(scorer, row, check=i % CHECK_EVERY == 1)
                    except (PromptTooLong, LetteredInputError) as exc:
                        skipped[f"{row.split}:{row.id}"] = type(exc).__name__
                        scorer.embedding_mode(True)
                        continue
                    done[f"{row.split}:{row.id}"] = o
                    f.write(json.dumps({"key": key, **o.to_json()}) + "\n")
                    f.flush()
                    if i % 50 == 0 or i == len(todo):
                        el = time.perf_counter() - t_start
                        console.print(f"  {i}/{len(todo)} rows, {el / i:.2f} s a row, {el / 60:.1f} min")
        finally:
            scorer.close()
    run_s = time.perf_counter() - t_start
    for k, why in skipped.items():
        counts[set_of[k]][k.split(":", 1)[0]]["too_long" if why == "PromptTooLong" else "input_error"] += 1

    outcomes = [done[f"{r.split}:{r.id}"] for r in rows if f"{r.split}:{r.id}" in done]
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
        "fits": {
            "b_hidden_probe": {"C": c_b, "cv_auroc": cv_b},
            "c_probe_plus_conf": {"C": c_c, "cv_auroc": cv_c},
        },
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
        ],
    }
    _print(console, result)
    save(console, out, result)
    return result


def _versions() -> dict[str, str]:
    import llama_cpp
    import sklearn

    return {
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "scikit_learn": sklearn.__version__,
        "numpy": np.__version__,
    }


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print(console: Console, res: dict[str, Any]) -> None:
    t = res["test"]
    iv = t["pooled_interval_95"]
    table = Table(title="Right/wrong AUROC of the scorer's answers (test rows; fits on dev rows)")
    for col in ("set", "test rows", "accuracy", "(a) top prob", "(a) gate scale", "(b) hidden probe", "(c) (b)+conf"):
        table.add_column(col, justify="left" if col == "set" else "right")
    for name, s in t["per_set"].items():
        a = s["auroc"]
        table.add_row(
            name,
            str(s["test_rows"]),
            f"{s['accuracy']:.2f}",
            _f(a["a_top_prob"]),
            _f(a["a_gate_scale"]),
            _f(a["b_hidden_probe"]),
            _f(a["c_probe_plus_conf"]),
        )

    def cell(k: str) -> str:
        return f"{_f(t['pooled_auroc'][k])} [{iv[k]['lo']:.3f}, {iv[k]['hi']:.3f}]"

    r = res["rows"]
    table.add_row(
        "pooled",
        str(r["test_used"]),
        _f(r["test_share_right"]),
        cell("a_top_prob"),
        cell("a_gate_scale"),
        cell("b_hidden_probe"),
        cell("c_probe_plus_conf"),
        style="bold",
    )
    console.print(table)
    for k in ("b_hidden_probe", "c_probe_plus_conf", "a_gate_scale"):
        d = iv[k]
        console.print(
            f"{k} - a_top_prob, pooled: {d['diff_vs_a_top_prob']:+.3f} [{d['diff_lo']:+.3f}, {d['diff_hi']:+.3f}]"
        )
    console.print(
        f"set's dev accuracy alone, pooled: {_f(t['pooled_auroc']['set_dev_accuracy'])}; "
        f"ECE of (c) {t['ece_c']:.3f}, of (b) {t['ece_b']:.3f}, of (a) {t['ece_a_top_prob']:.3f}"
    )
    f, tm, ck = res["fits"], res["timings"], res["one_pass_check"]
    console.print(
        f"C: (b) {f['b_hidden_probe']['C']}, (c) {f['c_probe_plus_conf']['C']}; rows dev {r['dev_used']}, "
        f"test {r['test_used']}, skipped {r['skipped']}; {tm['seconds_per_row_mean']:.2f} s a row "
        f"(p50 {tm['seconds_per_row_p50']:.2f})"
    )
    if ck["rows"]:
        console.print(
            f"one pass vs embedding mode off, {ck['rows']} rows: same answer {ck['same_answer']:.3f}, "
            f"largest probability difference {ck['max_abs_prob_diff']:.2e}, {ck['seconds_plain_mean']:.2f} s "
            f"off vs {ck['seconds_embedding_mean']:.2f} s on"
        )
    console.print(
        f"the learned gate's {GATE_AUROC} (docs/benchmarks.md; goal >= {GOAL}) is from another run on other "
        "rows: not comparable row for row"
    )
