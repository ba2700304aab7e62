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

import base64
import ctypes
import json
import logging
import os
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


class LayerTap:
    """llama.cpp's graph-evaluation callback (``cb_eval``): keeps the last column (the last token of
    the decode) of each wanted layer's residual stream, the tensors named ``l_out-<il>`` in
    llama.cpp's graph (the output of transformer layer ``il``, before any later norm). Read through
    libggml-base's accessors (name, type, rows, ``ggml_backend_tensor_get``), not a copy of the
    tensor struct's layout."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        import llama_cpp

        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        found = sorted(lib_dir.glob("libggml-base.*"))
        if not found:
            raise SystemExit(f"no libggml-base under {lib_dir}: cannot read llama.cpp's tensors")
        g = ctypes.CDLL(str(found[0]))
        g.ggml_get_name.restype, g.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        g.ggml_nelements.restype, g.ggml_nelements.argtypes = ctypes.c_int64, [ctypes.c_void_p]
        g.ggml_nrows.restype, g.ggml_nrows.argtypes = ctypes.c_int64, [ctypes.c_void_p]
        g.ggml_is_contiguous.restype, g.ggml_is_contiguous.argtypes = ctypes.c_bool, [ctypes.c_void_p]
        g.ggml_backend_tensor_get.restype = None
        g.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self._g = g
        self._f32 = llama_cpp.GGML_TYPE_F32
        self.wanted = {f"l_out-{il}".encode(): il for il in layers}
        self.got: dict[int, np.ndarray] = {}
        self.error: str | None = None
        # Referenced for the context's life: llama.cpp holds only the C pointer.
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._eval)

    def _eval(self, t: int | None, ask: bool, _user: int | None) -> bool:
        try:
            il = self.wanted.get(self._g.ggml_get_name(t))
            if ask or il is None:
                return il is not None  # ask: observe only the wanted tensors; others: carry on
            kind = ctypes.c_int.from_address(t).value  # enum ggml_type, the struct's first member
            if kind != self._f32 or not self._g.ggml_is_contiguous(t):
                self.error = f"l_out-{il}: type {kind}, contiguous {self._g.ggml_is_contiguous(t)}"
                return True
            rows = int(self._g.ggml_nrows(t))
            width = int(self._g.ggml_nelements(t)) // rows
            col = np.empty(width, dtype=np.float32)
            self._g.ggml_backend_tensor_get(t, col.ctypes.data, (rows - 1) * width * 4, width * 4)
            self.got[il] = col
        except Exception as exc:  # an exception cannot cross into C: kept, and raised after the decode
            self.error = repr(exc)
        return True


class ProbedScorer(ChatScorer):
    """The gateway's lettered scorer, whose context can also return the last position's hidden
    state from the same decode (embedding mode, no pooling) and, with ``layers``, the residual
    stream after those layers at the last position (:class:`LayerTap` on a context built again
    with llama.cpp's ``cb_eval``)."""

    def __init__(self, path: Path, n_ctx: int, n_threads: int, n_batch: int, layers: tuple[int, ...] = ()) -> None:
        super().__init__(path, n_ctx, n_threads, n_batch)
        self.n_layer = int(self._lib.llama_model_n_layer(self._model.model))
        bad = [il for il in layers if not 0 <= il < self.n_layer]
        if bad:
            raise SystemExit(f"--layers {bad}: the model has layers 0-{self.n_layer - 1}")
        self.tap = LayerTap(layers) if layers else None
        if self.tap is not None:  # the same parameters as the gateway's context, plus the callback
            from llama_cpp import _internals as internals

            params = self._ctx.params
            self._ctx.close()
            params.cb_eval = self.tap.callback
            params.cb_eval_user_data = None
            self._ctx = internals.LlamaContext(model=self._model, params=params, verbose=False)
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

    def layer_states(self) -> dict[int, np.ndarray]:
        """The wanted layers' states at the last position of the last decode; empties the tap."""
        assert self.tap is not None
        got, error = self.tap.got, self.tap.error
        self.tap.got, self.tap.error = {}, None
        if error or len(got) != len(self.tap.wanted) or any(v.size != self.n_embd for v in got.values()):
            shapes = {il: v.size for il, v in got.items()}
            raise RuntimeError(f"layer capture failed: {error or shapes} (n_embd {self.n_embd})")
        return got

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


def _b64(v: np.ndarray) -> str:
    return base64.b64encode(v.astype(np.float32).tobytes()).decode()


def _unb64(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.float32).copy()


@dataclass
class LayerStates:
    """One row's residual-stream states after the requested layers at the answer position, and
    how its pass compared with the row's cached answer."""

    states: dict[int, np.ndarray]
    seconds: float  # the lettered scoring with the tap on (embedding mode off unless the row was new)
    same_answer: bool
    max_abs_prob_diff: float  # against the cached probabilities (0 when from the same decode)


def _load_layers(path: Path, key: str) -> dict[str, LayerStates]:
    done: dict[str, LayerStates] = {}
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if doc.get("key") != key:
            continue
        k = f"{doc['split']}:{doc['id']}"
        states = {int(il): _unb64(v) for il, v in doc["layers"].items()}
        if k in done:  # a later pass with other layers: merged
            states = {**done[k].states, **states}
        done[k] = LayerStates(states, doc["seconds"], doc["same_answer"], doc["max_abs_prob_diff"])
    return done


def layer_row(scorer: ProbedScorer, row: Row, cached: Outcome) -> LayerStates:
    """A row already scored: the same lettered scoring again as the gateway runs it (embedding
    mode off), for the tap's states; the answer is checked against the cached one."""
    scorer.embedding_mode(False)
    t0 = time.perf_counter()
    got = scorer.score_question(row.question)
    states = scorer.layer_states()
    seconds = time.perf_counter() - t0
    probs = _probs(got.logprobs)
    return LayerStates(
        states,
        seconds,
        int(np.argmax(probs)) == int(np.argmax(cached.probs)),
        float(np.max(np.abs(np.array(probs) - np.array(cached.probs)))),
    )


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


def scorer_spec() -> tuple[GGUFScorerBackendSpec, Path, str]:
    """The default policy's scorer, its GGUF file, and the key its rows are cached under."""
    spec = load(POLICY).backends["scorer"]
    assert isinstance(spec, GGUFScorerBackendSpec), "the default policy's scorer is a gguf_scorer"
    path = gguf.model_file(spec.gguf.package, spec.gguf.path)
    return spec, path, f"{path.name}:{PROMPT_VERSION}:{spec.n_ctx}"


def run(
    per_set: int, sets: tuple[str, ...], threads: int, data: Path, out: Path, layers: tuple[int, ...] = ()
) -> dict[str, Any]:
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
    if res["settings"]["layers"]:
        _print_layers(console, res)
    console.print(
        f"the learned gate's {GATE_AUROC} (docs/benchmarks.md; goal >= {GOAL}) is from another run on other "
        "rows: not comparable row for row"
    )


def _print_layers(console: Console, res: dict[str, Any]) -> None:
    t, fits = res["test"], res["fits"]
    iv, pooled = t["pooled_interval_95"], t["pooled_auroc"]
    keys = ["a_top_prob", "b_hidden_probe"]
    keys += [f"layer_{il}_probe" for il in res["settings"]["layers"]] + ["layers_concat_plus_conf"]
    table = Table(title="Probes by layer: right/wrong AUROC on the test rows (fits on dev rows)")
    for col in ("score", "pooled [95%]", "- top prob [95%]", "C", *t["per_set"]):
        table.add_column(col, justify="left" if col == "score" else "right")
    for k in keys:
        d = iv[k]
        diff = "" if k == "a_top_prob" else f"{d['diff_vs_a_top_prob']:+.3f} [{d['diff_lo']:+.3f}, {d['diff_hi']:+.3f}]"
        table.add_row(
            k,
            f"{_f(pooled[k])} [{d['lo']:.3f}, {d['hi']:.3f}]",
            diff,
            str(fits[k]["C"]) if k in fits else "",
            *(_f(s["auroc"][k]) for s in t["per_set"].values()),
        )
    console.print(table)
    lp = res["layer_pass"]
    if lp and lp["rows"]:
        console.print(
            f"layer pass, {lp['rows']} rows: same answer as cached {lp['same_answer']:.3f}, largest probability "
            f"difference {lp['max_abs_prob_diff']:.2e}, {lp['seconds_per_row_mean']:.2f} s a row "
            f"(p50 {lp['seconds_per_row_p50']:.2f})"
        )
