"""The hidden-state probe's scorer (``benchmarks/hidden_probe.py``): the packaged GGUF scorer with a tap on
its layers, one row scored (its options' probabilities and the hidden state read), and the readings
cached on disk between runs."""

from __future__ import annotations

import base64
import ctypes
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.lettered import ChatScorer
from benchmarks.hidden_probe_stats import (
    Outcome,
)
from eval.tier_outputs import Row


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


def _keyed(path: Path, key: str) -> Iterator[dict[str, Any]]:
    """The cache file's lines written under ``key``, without it (a line cut short by an interruption
    is skipped)."""
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if doc.pop("key", None) == key:
            yield doc


def _load_layers(path: Path, key: str) -> dict[str, LayerStates]:
    done: dict[str, LayerStates] = {}
    for doc in _keyed(path, key):
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
    for doc in _keyed(path, key):
        if "skipped" not in doc:
            o = Outcome.from_json(doc)
            done[f"{o.split}:{o.id}"] = o
    return done
