"""The router-probe bench's second kind of reading (``--reading letters``): a local GGUF chat model's
own answer to a lettered multiple-choice prompt (RouteLLM MMLU's "question, A. .. D., Answer:"), as
the cascade's lettered scorer reads it (:class:`backends.lettered.ChatScorer`, one prefill, the
label tokens' probabilities at the answer position). What the router is given is how sure the
small model is, not which letter it picked: its label probabilities sorted from the highest, their
entropy (over log of the option count) and the probability mass on the labels at all. RouteLLM's
causal-LM router and the P(IK) cascades read a model's own confidence this way.

Readings are kept under ``out/router-probe/`` by the prompt's SHA-256 (saved every 50), so an
interrupted run resumes; they are made by ``workers`` processes of one llama.cpp thread each (one
thread is fastest a prompt on these machines, docs/design.md).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

WIDTH = 4  # label probabilities kept (the highest first; fewer options: zeros)
FEATURES = WIDTH + 2  # ... then the entropy and the label mass
_OPTION = re.compile(r"\n([A-J])\. ")
_scorer: Any = None  # one per worker process


def parse(prompt: str) -> tuple[str, tuple[str, ...]] | None:
    """The question and its options of a lettered prompt ("text\\nA. x\\nB. y ... Answer:"), or None."""
    body = prompt.rstrip().removesuffix("Answer:").rstrip()
    start = body.rfind("\nA. ")  # the options' block: the last "A." on a line of its own ("I. DNA" above it stays)
    if start < 0:
        return None
    parts = _OPTION.split(body[start:])
    letters, options = parts[1::2], tuple(o.strip() for o in parts[2::2])
    if len(options) < 2 or letters != [chr(ord("A") + i) for i in range(len(options))] or not all(options):
        return None
    return body[:start].strip(), options


def features(logprobs: tuple[float, ...], label_mass: float) -> np.ndarray:
    p = np.sort(np.exp(np.asarray(logprobs, dtype=np.float64)))[::-1]
    out = np.zeros(FEATURES, dtype=np.float32)
    out[: min(WIDTH, len(p))] = p[:WIDTH]
    out[WIDTH] = float(-(p * np.log(np.maximum(p, 1e-12))).sum() / math.log(len(p)))
    out[WIDTH + 1] = label_mass
    return out


def _open(model: str, n_ctx: int) -> None:
    global _scorer
    from backends.lettered import ChatScorer

    _scorer = ChatScorer(Path(model), n_ctx=n_ctx, n_threads=1)


def _read(text: str) -> tuple[list[float], float, int]:
    """One prompt's features, the seconds it took and its prompt tokens (a prompt that is not lettered,
    or too long: zeros)."""
    import time

    from backends.lettered import LetteredInputError
    from policies.cascade import Question
    from policies.errors import TriageError

    t0 = time.perf_counter()
    found = parse(text)
    if found is None:
        return [0.0] * FEATURES, 0.0, 0
    try:
        s = _scorer.score_question(Question(type="choice", question=found[0], options=found[1]))
    except (LetteredInputError, TriageError):
        return [0.0] * FEATURES, 0.0, 0
    return features(s.logprobs, s.label_mass).tolist(), time.perf_counter() - t0, int(s.prompt_tokens)


class LetterCache:
    def __init__(self, model: Path, n_ctx: int, workers: int, folder: Path, say: Callable[[str], None] = print) -> None:
        self.model, self.n_ctx, self.workers, self.say = model, n_ctx, workers, say
        self.file = folder / f"letters-{model.stem}-{n_ctx}.npz"
        self.vectors: dict[str, np.ndarray] = {}
        self.seconds: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
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
        todo = [t for t in dict.fromkeys(texts) if self.key(t) not in self.vectors]
        if todo:
            self.say(f"reading {len(todo)} prompts with {self.model.name} ({self.workers} processes)")
            with ProcessPoolExecutor(self.workers, initializer=_open, initargs=(str(self.model), self.n_ctx)) as pool:
                for k, (text, (v, s, n)) in enumerate(zip(todo, pool.map(_read, todo, chunksize=4), strict=True)):
                    key = self.key(text)
                    self.vectors[key], self.seconds[key], self.tokens[key] = np.asarray(v, np.float32), s, n
                    if (k + 1) % 50 == 0:
                        self.save()
                        self.say(f"  {k + 1} of {len(todo)}")
            self.save()
        return np.stack([self.vectors[self.key(t)] for t in texts])

    def save(self) -> None:
        keys = sorted(self.vectors)
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp.npz")
        np.savez(
            tmp,
            keys=np.array(keys),
            x=np.stack([self.vectors[k] for k in keys]) if keys else np.zeros((0, FEATURES), np.float32),
            seconds=np.array([self.seconds[k] for k in keys]),
            tokens=np.array([self.tokens[k] for k in keys]),
        )
        tmp.replace(self.file)

    def ms_p50(self, texts: list[str]) -> float | None:
        s = [self.seconds[self.key(t)] for t in texts if self.key(t) in self.seconds and self.seconds[self.key(t)] > 0]
        return float(np.median(s) * 1000) if s else None

    def tokens_mean(self, texts: list[str]) -> float | None:
        n = [self.tokens[self.key(t)] for t in texts if self.key(t) in self.tokens and self.tokens[self.key(t)] > 0]
        return float(np.mean(n)) if n else None

    def close(self) -> None:
        """Nothing held between calls (the worker processes end with each call)."""
