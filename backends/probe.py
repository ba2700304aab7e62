"""The ``gguf_probe`` backend: the learned router's difficulty probe, a small GGUF model's reading
of a prompt for a routed model's second quality head (``probe`` on a routed model, docs/router.md):
``reading: hidden``, its final hidden state, mean-pooled (:mod:`backends.hidden`); ``reading:
letters``, how sure it is of its own answer to a lettered prompt (:mod:`backends.letters`), one
prefill; ``reading: answer``, how sure it is while it writes a short answer to any prompt
(:mod:`backends.answer`), a prefill and a few greedy tokens. In the file's worker process
(``backends.engine_host``): a fault there costs the probe, which the router then does without, never
the gateway. It serves no chat (``backends.local_engine``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from backends import answer, letters
from backends.engine_host import EngineSpec
from backends.engine_wire import question_to_wire, scores_from_wire
from backends.hidden import CUT_CHARS_PER_TOKEN
from backends.lettered import LetteredScores
from backends.local_engine import LocalEngineBackend
from policies.errors import UpstreamError

SMOOTHING = 0.2  # the weight of the newest reading in the typical reading time
# the time a character is learnt from readings of at least this many (a shorter one's time is mostly
# the worker's fixed cost a reading, which would make every longer prompt look too slow to read)
PER_CHAR_FROM = 200


class ProbeBackend(LocalEngineBackend):
    """Readings queue on the worker's one context. One that would surely be late is not queued:
    where readings are already waiting and those ahead, at the typical reading time, would take
    the caller's timeout; where the prompt, at the typical time a character, would take it alone
    (a long lettered prompt: a prefill cannot be stopped, and one running past the worker's hang
    grace would restart the worker other engines on the file share); or where the worker is down
    (restarting, or never loaded), the reading fails at once and the router does without it."""

    what = "reads prompts for the router"
    label = "probe"

    def __init__(self, name: str, spec: Any) -> None:
        super().__init__(name, spec)
        self.in_flight = 0
        self.typical_s: float | None = None  # a successful reading's time, smoothed, less its queueing
        self.per_char_s: float | None = None  # the same over the characters sent, smoothed (long prompts')

    def engine_spec(self) -> EngineSpec:
        s = self.spec
        if s.reading in ("letters", "answer"):  # the cascade's lettered scorer, on a context of its own
            return EngineSpec("scorer", s.n_ctx, s.n_threads, 512)
        return EngineSpec("hidden", s.n_ctx, s.n_threads, s.n_ctx)

    def can_read(self, text: str) -> bool:
        """Whether the probe reads this prompt: a hidden state, any that is not empty; letters, a
        lettered one (its options in one block, then "Answer:") short enough to be read whole; answer,
        any with a word in it short enough to be read whole."""
        if self.spec.reading == "hidden":
            return bool(text)
        if len(text) > CUT_CHARS_PER_TOKEN * self.spec.n_ctx:
            return False
        return bool(text.strip()) if self.spec.reading == "answer" else letters.question(text) is not None

    async def read(self, text: str, timeout_s: float) -> tuple[np.ndarray, int]:
        """The prompt's reading and the tokens read: a hidden state, a unit vector (a longer prompt is
        cut at ``n_ctx``); letters, :func:`backends.letters.features`; answer,
        :func:`backends.answer.features` (UpstreamError for a prompt :meth:`can_read` refuses)."""
        if not self.healthy():  # not loaded, or its worker down
            raise UpstreamError(f"probe {self.name} is down: {self.problem() or 'not serving yet'}")
        typical = self.typical_s
        if self.in_flight and typical is not None and (self.in_flight + 1) * typical > timeout_s:
            raise UpstreamError(
                f"probe {self.name} is busy: {self.in_flight} readings ahead at {typical * 1000:.0f} ms each "
                f"would pass the {timeout_s:g}s timeout"
            )
        sent = self._sent(text)
        if self.per_char_s is not None and len(sent) * self.per_char_s > timeout_s:
            raise UpstreamError(
                f"probe {self.name}: a prompt of {len(sent)} characters would take about "
                f"{len(sent) * self.per_char_s:.1f}s at its typical speed, past the {timeout_s:g}s timeout"
            )
        ahead = self.in_flight
        self.in_flight += 1
        t0 = time.perf_counter()
        try:
            vector, tokens = await self._read(sent, timeout_s)
        finally:
            self.in_flight -= 1
        # its own reading's share of the wait: with k readings ahead of it, it waited for k + 1
        took = (time.perf_counter() - t0) / (ahead + 1)
        self.typical_s = _smoothed(self.typical_s, took)
        if len(sent) >= PER_CHAR_FROM:
            self.per_char_s = _smoothed(self.per_char_s, took / len(sent))
        return vector, tokens

    def _sent(self, text: str) -> str:
        """What crosses to the worker: a hidden state's prompt cut at 8 characters a token of ``n_ctx``
        (its first ``n_ctx`` tokens are all that is read); one to answer, whole."""
        return text if self.spec.reading != "hidden" else text[: CUT_CHARS_PER_TOKEN * self.spec.n_ctx]

    async def _read(self, text: str, timeout_s: float) -> tuple[np.ndarray, int]:
        if self.spec.reading == "letters":
            q = letters.question(text)
            if q is None:
                raise UpstreamError(f"probe {self.name} reads lettered prompts only")
            scores = scores_from_wire(await self.call("score_question", {"question": question_to_wire(q)}, timeout_s))
            if not isinstance(scores, LetteredScores):
                raise UpstreamError(f"probe {self.name} answered no label probabilities")
            return letters.features(scores.logprobs, scores.label_mass), scores.prompt_tokens
        if self.spec.reading == "answer":
            if not text.strip():
                raise UpstreamError(f"probe {self.name} has nothing to answer")
            steps = await self.call("answer", {"text": text, "limit": answer.TOKENS}, timeout_s)
            try:
                return answer.from_wire(steps)
            except (KeyError, TypeError, ValueError) as exc:
                raise UpstreamError(f"probe {self.name} answered no steps: {exc!r}") from None
        got = await self.call("read", {"text": text}, timeout_s)
        try:
            return np.asarray(got["vector"], dtype=np.float32), int(got["tokens"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UpstreamError(f"probe {self.name} answered no vector: {exc!r}") from None


def _smoothed(before: float | None, newest: float) -> float:
    return newest if before is None else (1 - SMOOTHING) * before + SMOOTHING * newest


def factory(name: str, spec: Any) -> ProbeBackend:
    return ProbeBackend(name, spec)
