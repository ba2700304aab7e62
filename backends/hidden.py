"""A GGUF model's reading of a prompt: its final hidden state, mean-pooled over the prompt's
tokens (llama.cpp's embedding mode: one prefill, no generation), L2-normalised.

The learned router's difficulty probe (a routed model's ``probe``, docs/router.md) reads it: served
in the file's worker process (the ``gguf_probe`` backend, :mod:`backends.probe`), read in this
process by ``triage train`` and ``triage eval`` (:class:`HiddenCache`, which keeps each prompt's
vector on disk so that a second run reads no prompt again). Both call :class:`HiddenReader`, so the
vectors a head is fitted on are the ones it is served.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from policies.paths import cache_dir

# a prompt is cut at this many characters a token of n_ctx before it is tokenized or sent to the
# worker: a huge prompt costs no more than a long one (its first n_ctx tokens are all that is read)
CUT_CHARS_PER_TOKEN = 8


class HiddenReader:
    """One llama.cpp context in embedding mode with mean pooling. Not thread-safe: one caller at a time."""

    def __init__(self, path: Path, n_ctx: int = 512, n_threads: int = 1, n_batch: int = 512) -> None:
        from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp's own log lines go to stderr otherwise
        self.path = path
        self.llm: Any = Llama(
            model_path=str(path),
            embedding=True,
            pooling_type=LLAMA_POOLING_TYPE_MEAN,
            n_ctx=n_ctx,
            n_batch=max(n_batch, n_ctx),  # embedding mode takes the whole prompt in one batch
            n_ubatch=max(n_batch, n_ctx),
            n_threads=n_threads,
            n_threads_batch=n_threads,
            verbose=False,
        )
        self.n_ctx = n_ctx

    def read(self, text: str) -> tuple[np.ndarray, int]:
        """The prompt's unit vector and how many of its tokens were read: its first ``n_ctx`` (a
        longer text is cut at 8 characters a token before it is tokenized, so a huge prompt costs no
        more than a long one). ValueError for a prompt of no tokens: llama.cpp fails that decode and
        then faults when the context is freed."""
        cut = text[: CUT_CHARS_PER_TOKEN * self.n_ctx]
        clean = cut.encode("utf-8", "replace").decode("utf-8")  # lone surrogates: '?'
        tokens = min(len(self.llm.tokenize(clean.encode("utf-8"))), self.n_ctx)
        if tokens == 0:
            raise ValueError("the probe has nothing to read: the prompt has no tokens")
        v = np.asarray(self.llm.embed(clean, truncate=True), dtype=np.float32)
        return unit(v), tokens

    def close(self) -> None:
        self.llm.close()


def unit(v: np.ndarray) -> np.ndarray:
    """``v`` (one vector or rows of them) at length 1."""
    norm = np.linalg.norm(v, axis=-1, keepdims=True)
    out: np.ndarray = v / np.maximum(norm, 1e-12)
    return out


class HiddenCache:
    """:class:`HiddenReader`'s vectors of many prompts, kept on disk by the SHA-256 of the text
    (``<cache>/hidden/<file>-<digest>.npz``), with each prompt's reading time. The reader is
    opened on the first prompt not in the file. A subclass that reads something else from the same
    file names its own readings' file by ``kind``."""

    kind = ""  # the file's name starts with it: another reading of the same model keeps its own file

    def __init__(
        self,
        path: Path,
        n_ctx: int = 512,
        n_threads: int = 1,
        folder: Path | None = None,
        say: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.model = path
        self.n_ctx, self.n_threads = n_ctx, n_threads
        self.say = say
        digest = hashlib.sha256(f"{path.name}:{path.stat().st_size}:{n_ctx}".encode()).hexdigest()[:12]
        self.file = (folder or cache_dir() / "hidden") / f"{self.kind}{path.stem}-{digest}.npz"
        self.vectors: dict[str, np.ndarray] = {}
        self.seconds: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self._reader: HiddenReader | None = None
        if self.file.exists():
            with np.load(self.file, allow_pickle=False) as z:
                keys = z["keys"].tolist()
                self.vectors = dict(zip(keys, z["x"], strict=True))
                self.seconds = dict(zip(keys, z["seconds"].tolist(), strict=True))
                self.tokens = dict(zip(keys, z["tokens"].tolist(), strict=True))

    @staticmethod
    def key(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()

    def __call__(self, texts: list[str]) -> np.ndarray:
        """The prompts' vectors, (rows, hidden width), read where not kept yet; a prompt of no tokens
        reads as zeros (the gateway does not probe one)."""
        todo = [t for t in dict.fromkeys(texts) if self.key(t) not in self.vectors]
        if todo and self._reader is None:
            self._reader = HiddenReader(self.model, self.n_ctx, self.n_threads)
        try:
            for k, text in enumerate(todo):
                assert self._reader is not None
                t0 = time.perf_counter()
                try:
                    v, n = self._reader.read(text)
                except ValueError:  # nothing to read
                    v, n = np.zeros(self._reader.llm.n_embd(), dtype=np.float32), 0
                key = self.key(text)
                self.seconds[key], self.tokens[key], self.vectors[key] = time.perf_counter() - t0, n, v
                if (k + 1) % 250 == 0:
                    self.save()
                    self.say(f"  {self.model.name}: {k + 1}/{len(todo)} prompts read")
        finally:
            if todo:
                self.save()
        return np.stack([self.vectors[self.key(t)] for t in texts]) if texts else np.zeros((0, 0), np.float32)

    def ms_p50(self, texts: list[str]) -> float | None:
        """The median time of reading these prompts (when they were read), in milliseconds."""
        got = [self.seconds[k] for k in map(self.key, texts) if k in self.seconds and np.isfinite(self.seconds[k])]
        return float(np.median(got) * 1000) if got else None

    def tokens_mean(self, texts: list[str]) -> float | None:
        """The mean tokens read of these prompts."""
        got = [self.tokens[k] for k in map(self.key, texts) if k in self.tokens]
        return float(np.mean(got)) if got else None

    def save(self) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        keys = list(self.vectors)
        tmp = self.file.with_suffix(".tmp.npz")
        np.savez(
            tmp,
            keys=np.array(keys),
            x=np.stack([self.vectors[k] for k in keys]),
            seconds=np.array([self.seconds.get(k, np.nan) for k in keys]),
            tokens=np.array([self.tokens.get(k, 0) for k in keys]),
        )
        tmp.replace(self.file)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
