"""The ``gguf_scorer`` backend: the cascade's local tier, scoring options without generating.

It is a backend like the others but it serves no chat (``backends.local_engine``). Scoring runs
in the file's worker process (``backends.engine_host``), one question at a time per context.

Modes, chosen per tier: ``score`` (cloze: each option as a continuation of a prompt the
tier wrote) and ``score_question`` (lettered: the options listed with letters in the model's
chat template, read from the next token; reasoned: the same after a few sentences the model
writes; see ``backends.lettered``).
"""

from __future__ import annotations

from typing import Any

from backends.engine_host import EngineSpec
from backends.engine_wire import question_to_wire, scores_from_wire
from backends.local_engine import LocalEngineBackend
from backends.logprob import OptionScores
from policies.cascade import Question


class ScorerBackend(LocalEngineBackend):
    what = "scores options"
    label = "scorer"

    def engine_spec(self) -> EngineSpec:
        s = self.spec
        return EngineSpec("scorer", s.n_ctx, s.n_threads, s.n_batch)

    async def score(self, prompt: str, options: list[str], timeout_s: float) -> OptionScores:
        """Cloze: log P(option | prompt) per option."""
        return scores_from_wire(await self.call("score", {"prompt": prompt, "options": options}, timeout_s))

    async def score_question(self, question: Question, timeout_s: float, reason_tokens: int = 0) -> OptionScores:
        """Lettered: log P(label) per option, renormalised over the labels (one token each); with
        ``reason_tokens``, after the model has written up to that many (reasoned)."""
        args = {"question": question_to_wire(question), "reason_tokens": reason_tokens}
        return scores_from_wire(await self.call("score_question", args, timeout_s))


def factory(name: str, spec: Any) -> ScorerBackend:
    return ScorerBackend(name, spec)
