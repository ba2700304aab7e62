"""The difficulty probe's second kind of reading (``reading: letters`` on a ``gguf_probe`` backend,
``--reading letters`` in the router-probe bench): a local GGUF chat model's own answer to a lettered
multiple-choice prompt (RouteLLM MMLU's "question, A. .. D., Answer:"), as the cascade's lettered
scorer reads it (:class:`backends.lettered.ChatScorer`, one prefill, the label tokens'
probabilities at the answer position). What the router is given is how sure the small model is,
not which letter it picked: its label probabilities sorted from the highest, their entropy (over
log of the option count) and the probability mass on the labels at all. RouteLLM's causal-LM
router and the P(IK) cascades read a model's own confidence this way. A prompt that is not
lettered has nothing to read: the router does without the probe there.

Served, the reading runs in the file's worker process (:mod:`backends.probe`); offline
(``triage train``, ``triage calibrate``, the bench) :class:`LetterCache` keeps each prompt's
reading on disk by its SHA-256 (saved every 50), so an interrupted run resumes; they are made by
``n_threads`` processes of one llama.cpp thread each (one thread is fastest a prompt on these
machines, docs/design.md). :class:`TwoOrderLetterCache` reads a prompt as given and with its options
reversed, for the bench only (``--reading letters2``): measured to move the router by nothing at twice
the reading's time, it is not served.
"""

from __future__ import annotations

import math
import multiprocessing
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from backends.hidden import HiddenCache
from policies.cascade import Question

WIDTH = 4  # label probabilities kept (the highest first; fewer options: zeros)
FEATURES = WIDTH + 2  # ... then the entropy and the label mass
FEATURES_TWO = FEATURES + 2  # two orders: of their mean, then whether they agree and the second's P(first pick)
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


def question(prompt: str) -> Question | None:
    """A lettered prompt as the lettered scorer's question (type ``choice``), or None: nothing to read."""
    found = parse(prompt)
    return None if found is None else Question(type="choice", question=found[0], options=found[1])


def features(logprobs: tuple[float, ...], label_mass: float) -> np.ndarray:
    """How sure the model is of its answer: its label probabilities sorted (the first ``WIDTH``), their
    entropy over log of the option count, and the label mass."""
    p = np.sort(np.exp(np.asarray(logprobs, dtype=np.float64)))[::-1]
    out = np.zeros(FEATURES, dtype=np.float32)
    out[: min(WIDTH, len(p))] = p[:WIDTH]
    out[WIDTH] = float(-(p * np.log(np.maximum(p, 1e-12))).sum() / math.log(len(p)))
    out[WIDTH + 1] = label_mass
    return out


def features_of_orders(first: tuple[float, ...], turned: np.ndarray, label_mass: float) -> np.ndarray:
    """Two orders' reading (the options as given and reversed, ``turned`` mapped back to the given
    order): :func:`features` of the two readings' mean, whether the reversed order picks the same
    option, and its probability of the first order's pick. Where the pick moves with the letters, the
    model was guessing (``python -m benchmarks consistency``)."""
    a, b = np.exp(np.asarray(first, dtype=np.float64)), np.exp(np.asarray(turned, dtype=np.float64))
    pick = int(np.argmax(a))
    out = np.zeros(FEATURES_TWO, dtype=np.float32)
    out[:FEATURES] = features(tuple(np.log((a + b) / 2)), label_mass)
    out[FEATURES] = float(int(np.argmax(b)) == pick)
    out[FEATURES + 1] = b[pick]
    return out


def _open(model: str, n_ctx: int) -> None:
    global _scorer
    from backends.lettered import ChatScorer

    _scorer = ChatScorer(Path(model), n_ctx=n_ctx, n_threads=1)  # as the worker's scorer engine (n_batch 512)


def scorer() -> Any:
    """This reader process's :class:`backends.lettered.ChatScorer` (opened by the pool's initializer)."""
    return _scorer


def _read(text: str, orders: int = 1) -> tuple[list[float], float, int]:
    """One prompt's features (:func:`features`; two orders: :func:`features_of_orders`), the seconds it
    took and its prompt tokens (a prompt that is not lettered, or too long: zeros, its time NaN so that
    no median counts it)."""
    import time

    from backends.lettered import LetteredInputError, in_given_order, in_order, orderings
    from policies.errors import TriageError

    width = FEATURES if orders == 1 else FEATURES_TWO
    t0 = time.perf_counter()
    q = question(text)
    if q is None:
        return [0.0] * width, math.nan, 0
    try:
        read = [(o, _scorer.score_question(in_order(q, o))) for o in orderings(len(q.options), orders)]
    except (LetteredInputError, TriageError):
        return [0.0] * width, math.nan, 0
    (_, a), *rest = read
    tokens = sum(int(s.prompt_tokens) for _, s in read)
    if not rest:
        return features(a.logprobs, a.label_mass).tolist(), time.perf_counter() - t0, tokens
    order, b = rest[0]
    v = features_of_orders(a.logprobs, in_given_order(order, b.logprobs), (a.label_mass + b.label_mass) / 2)
    return v.tolist(), time.perf_counter() - t0, tokens


def _read_two(text: str) -> tuple[list[float], float, int]:
    """:func:`_read` in two orders, as given and with the options reversed."""
    return _read(text, 2)


class ScorerReadings(HiddenCache):
    """Readings made by a chat model's scorer (:class:`backends.lettered.ChatScorer`), kept as
    :class:`backends.hidden.HiddenCache` keeps hidden states (its file, keys, times and tokens), made by
    ``n_threads`` processes of one llama.cpp thread each. ``reader``: a module-level function of a
    prompt to its features, seconds and prompt tokens, run in those processes (:func:`scorer`)."""

    reader: Callable[[str], tuple[list[float], float, int]]

    def __call__(self, texts: list[str]) -> np.ndarray:
        todo = [t for t in dict.fromkeys(texts) if self.key(t) not in self.vectors]
        if todo:
            self.say(f"reading {len(todo)} prompts with {self.model.name} ({self.n_threads} processes)")
            init = (str(self.model), self.n_ctx)
            try:
                # spawned, not forked: the caller holds threads (the encoder's, a server's) a fork would copy mid-lock
                spawn = multiprocessing.get_context("spawn")
                with ProcessPoolExecutor(self.n_threads, spawn, initializer=_open, initargs=init) as pool:
                    done = pool.map(type(self).reader, todo, chunksize=4)
                    for k, (text, (v, sec, n)) in enumerate(zip(todo, done, strict=True)):
                        key = self.key(text)
                        self.vectors[key], self.seconds[key], self.tokens[key] = np.asarray(v, np.float32), sec, n
                        if (k + 1) % 50 == 0:
                            self.save()
                            self.say(f"  {k + 1} of {len(todo)}")
            finally:
                self.save()
        return np.stack([self.vectors[self.key(t)] for t in texts])


class LetterCache(ScorerReadings):
    """The readings of :func:`_read`: a lettered prompt's label probabilities."""

    kind = "letters-"
    reader = staticmethod(_read)


class TwoOrderLetterCache(ScorerReadings):
    """The readings of :func:`_read_two`: a lettered prompt read as given and with its options reversed."""

    kind = "letters2-"
    reader = staticmethod(_read_two)
