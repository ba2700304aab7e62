"""Option log-probabilities from a GGUF model, without generating (synchronous, one thread).

The prompt is evaluated once into sequence 0 of the KV cache; the tokens it shares with the
previous prompt (a few-shot template, one passage with several questions) are not evaluated
again. Each option then continues from that prefix in its own sequence (a copy of sequence 0,
which in llama.cpp's unified cache costs no memory), all options in one decode. Logits are
read only where they matter: the prompt's last position and each option's own positions, never
over the whole context.

A llama.cpp context is not thread-safe: callers serialise access (see ``backends.scorer``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAX_OPTIONS = 64


@dataclass(frozen=True)
class OptionScores:
    logprobs: tuple[float, ...]  # sum of the option's token log-probabilities
    tokens: tuple[int, ...]  # tokens per option
    prompt_tokens: int
    reused_tokens: int  # prompt tokens found in the cache, not evaluated again


class PromptTooLong(ValueError):
    pass


def _log_softmax_at(row: np.ndarray, ids: list[int]) -> list[float]:
    m = float(row.max())
    lse = m + float(np.log(np.exp(row - m, dtype=np.float64).sum()))
    return [float(row[i]) - lse for i in ids]


def load_model(path: Path) -> Any:
    """The file's weights (``llama_cpp._internals.LlamaModel``), which several contexts may share."""
    import llama_cpp
    from llama_cpp import _internals as internals
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # llama.cpp's own log lines go to stderr otherwise
    return internals.LlamaModel(path_model=str(path), params=llama_cpp.llama_model_default_params(), verbose=False)


class OptionScorer:
    """``model``: weights already loaded (shared with another context, which owns them); else
    the file is loaded and closed with this scorer."""

    def __init__(
        self, path: Path, n_ctx: int = 2048, n_threads: int = 1, n_batch: int = 512, model: Any = None
    ) -> None:
        import llama_cpp
        from llama_cpp import _internals as internals

        self._lib = llama_cpp
        self._owns_model = model is None
        self.cancelled: Callable[[], bool] = lambda: False  # checked before each token a reasoned ask writes
        self._model = load_model(path) if model is None else model
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.n_seq_max = min(MAX_OPTIONS + 1, n_batch, llama_cpp.llama_max_parallel_sequences())
        cparams.kv_unified = True  # options share the prompt's cells
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as llama_cpp.Llama: same numbers
        self._ctx = internals.LlamaContext(model=self._model, params=cparams, verbose=False)
        self._batch = internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=cparams.n_seq_max, verbose=False)
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_vocab = self._model.n_vocab()
        self.max_options = cparams.n_seq_max - 1
        self._cached: list[int] = []  # tokens held in sequence 0

    def close(self) -> None:
        for obj in (self._batch, self._ctx, self._model if self._owns_model else None):
            if obj is not None:
                obj.close()

    def tokenize(self, text: str, bos: bool) -> list[int]:
        return list(self._model.tokenize(text.encode("utf-8", "replace"), add_bos=bos, special=False))

    def _row(self, i: int) -> np.ndarray:
        ptr = self._ctx.get_logits_ith(i)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))

    def _add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        b = self._batch.batch
        j = b.n_tokens
        b.token[j], b.pos[j], b.seq_id[j][0], b.n_seq_id[j], b.logits[j] = token, pos, seq, 1, logits
        b.n_tokens = j + 1
        return j

    def _prefill(self, tokens: list[int]) -> tuple[np.ndarray, int]:
        """Evaluate ``tokens`` into sequence 0, reusing the common prefix; the last position's logits."""
        keep = 0
        limit = min(len(self._cached), len(tokens) - 1)  # the last token is evaluated again for its logits
        while keep < limit and self._cached[keep] == tokens[keep]:
            keep += 1
        self._ctx.kv_cache_seq_rm(0, keep, -1)
        self._cached = self._cached[:keep]
        rest = tokens[keep:]
        last = -1
        for start in range(0, len(rest), self.n_batch):
            self._batch.reset()
            chunk = rest[start : start + self.n_batch]
            for k, tok in enumerate(chunk):
                last = self._add(tok, keep + start + k, 0, start + k == len(rest) - 1)
            self._ctx.decode(self._batch)
            self._cached.extend(chunk)
        return self._row(last).copy(), keep

    def score(self, prompt: str, options: list[str]) -> OptionScores:
        """Log P(option | prompt) for each option (the option text as written: lead it with a
        space where the template wants one)."""
        if not 1 <= len(options) <= self.max_options:
            raise ValueError(f"between 1 and {self.max_options} options, not {len(options)}")
        ptoks = self.tokenize(prompt, bos=True)
        otoks = [self.tokenize(o, bos=False) or self.tokenize(" ", bos=False) for o in options]
        need = len(ptoks) + sum(len(t) - 1 for t in otoks)
        if need > self.n_ctx or max(len(t) for t in otoks) > self.n_batch:
            raise PromptTooLong(f"prompt and options need {need} tokens, the scorer's context holds {self.n_ctx}")
        first, reused = self._prefill(ptoks)
        totals = _log_softmax_at(first, [t[0] for t in otoks])
        self._continue(len(ptoks), otoks, totals)
        return OptionScores(tuple(totals), tuple(len(t) for t in otoks), len(ptoks), reused)

    def _continue(self, n_prompt: int, otoks: list[list[int]], totals: list[float]) -> None:
        """Add the log-probabilities of every option's second and later tokens, each option in its
        own sequence branched from the prompt; as many options per decode as the batch holds."""
        pending = [i for i, t in enumerate(otoks) if len(t) > 1]
        while pending:
            self._batch.reset()
            placed: list[tuple[int, int]] = []  # (option, batch index of its first continuation)
            while pending and self._batch.n_tokens() + len(otoks[pending[0]]) - 1 <= self.n_batch:
                i = pending.pop(0)
                seq = len(placed) + 1
                self._ctx.kv_cache_seq_cp(0, seq, 0, n_prompt)
                start = self._batch.n_tokens()
                for k, tok in enumerate(otoks[i][:-1]):
                    self._add(tok, n_prompt + k, seq, True)
                placed.append((i, start))
            self._ctx.decode(self._batch)
            for i, start in placed:
                for k, tok in enumerate(otoks[i][1:]):
                    totals[i] += _log_softmax_at(self._row(start + k), [tok])[0]
            for seq in range(1, len(placed) + 1):
                self._ctx.kv_cache_seq_rm(seq, -1, -1)
