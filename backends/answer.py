"""The difficulty probe's third kind of reading (``reading: answer`` on a ``gguf_probe`` backend,
``--reading answer`` in the router-probe bench): for any prompt, not only a lettered one, a local
GGUF chat model answers it briefly and greedily (asked for the final answer only, up to
:data:`TOKENS` tokens, :meth:`backends.lettered.ChatScorer.answer_steps`), and the router is given
how sure the model was while it answered, not what it answered: the first token's probability, the
runner-up's and the entropy there; over the answer, the geometric mean of the tokens' probabilities,
the least of them and the mean entropy; the answer's length over :data:`TOKENS` and whether the model
ended its turn within it. A P(T)-like reading for open questions (a number, a word, True or False),
where ``letters`` has no options to read.

Offline, :class:`AnswerCache` keeps the readings on disk as :class:`backends.letters.LetterCache` does.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from backends.letters import ScorerReadings, scorer

TOKENS = 16  # the longest answer read; a short final answer fits
FEATURES = 8


def features(top: tuple[float, ...], second: tuple[float, ...], entropy: tuple[float, ...], ended: bool) -> np.ndarray:
    """The eight numbers the router's second head reads of one answer (the module's docstring)."""
    out = np.zeros(FEATURES, dtype=np.float32)
    if not top:  # nothing was read (cancelled before the first step)
        return out
    p = np.maximum(np.asarray(top, dtype=np.float64), 1e-12)
    out[:3] = top[0], second[0], entropy[0]
    out[3] = math.exp(float(np.log(p).mean()))
    out[4] = float(p.min())
    out[5] = float(np.mean(entropy))
    out[6] = len(top) / TOKENS
    out[7] = float(ended)
    return out


def from_wire(d: dict[str, Any]) -> tuple[np.ndarray, int]:
    """The worker's ``answer`` result as the reading and its prompt tokens."""
    return features(tuple(d["top"]), tuple(d["second"]), tuple(d["entropy"]), bool(d["ended"])), int(d["prompt_tokens"])


def _read(text: str) -> tuple[list[float], float, int]:
    """One prompt's features, the seconds it took and its prompt tokens (an empty or too long prompt:
    zeros, its time NaN so that no median counts it)."""
    import time

    from backends.logprob import PromptTooLong

    t0 = time.perf_counter()
    try:
        s = scorer().answer_steps(text, TOKENS)
    except PromptTooLong:
        return [0.0] * FEATURES, math.nan, 0
    return features(s.top, s.second, s.entropy, s.ended).tolist(), time.perf_counter() - t0, s.prompt_tokens


class AnswerCache(ScorerReadings):
    """The readings of :func:`_read`: how sure the model was of its own short answer."""

    kind = "answer-"
    reader = staticmethod(_read)
