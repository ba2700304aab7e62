"""The ``gguf_scorer`` backend: the cascade's local tier, scoring options without generating.

It is a backend like the others (started and closed by the runtime, kept across reloads when
its spec is unchanged) but it serves no chat: a model that points at it fails validation, and
``complete`` refuses. Scoring runs in a worker thread, one question at a time per context.

Modes, chosen per tier: ``score`` (cloze: each option as a continuation of a prompt the
tier wrote) and ``score_question`` (lettered: the options listed with letters in the model's
chat template, read from the next token; reasoned: the same after a few sentences the model
writes; see ``backends.lettered``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from backends import gguf
from backends.base import Call, Capabilities, ChunkStream, Completion
from backends.lettered import ChatScorer, LetteredInputError
from backends.logprob import OptionScores, PromptTooLong
from backends.registry import register
from backends.serial import Serial
from policies.cascade import Question
from policies.errors import InvalidRequest, UpstreamError, UpstreamTimeout


class ScorerBackend:
    capabilities = Capabilities(chat=False, completions=False, streaming=False, n_choices=False, tools=False)

    def __init__(self, name: str, spec: Any) -> None:
        self.name = name
        self.spec = spec
        self._scorer: ChatScorer | None = None
        self._serial = Serial()

    async def start(self) -> None:
        path = await asyncio.to_thread(gguf.resolve, self.spec.gguf.package, self.spec.gguf.path)
        self._scorer = await asyncio.to_thread(
            ChatScorer, path, self.spec.n_ctx, self.spec.n_threads, self.spec.n_batch
        )

    async def close(self) -> None:
        async with self._serial.lock:
            scorer, self._scorer = self._scorer, None
            if scorer is not None:
                await asyncio.to_thread(scorer.close)

    def healthy(self) -> bool:
        return self._scorer is not None

    async def score(self, prompt: str, options: list[str], timeout_s: float) -> OptionScores:
        """Cloze: log P(option | prompt) per option."""
        return await self._run(lambda s: s.score(prompt, options), timeout_s)

    async def score_question(self, question: Question, timeout_s: float, reason_tokens: int = 0) -> OptionScores:
        """Lettered: log P(label) per option, renormalised over the labels (one token each); with
        ``reason_tokens``, after the model has written up to that many (reasoned)."""
        return await self._run(lambda s: s.score_question(question, reason_tokens), timeout_s)

    async def _run(self, fn: Callable[[ChatScorer], OptionScores], timeout_s: float) -> OptionScores:
        scorer = self._scorer
        if scorer is None:
            raise UpstreamError(f"scorer {self.name} is not loaded")

        def work() -> OptionScores:
            try:
                return fn(scorer)
            except (PromptTooLong, LetteredInputError) as exc:
                raise InvalidRequest(str(exc)) from None
            except (RuntimeError, ValueError) as exc:  # llama_decode failures, bad option counts
                raise UpstreamError(f"scorer {self.name} failed: {exc}", retryable=False) from None

        try:
            return await self._serial.run(work, timeout_s)
        except TimeoutError:
            raise UpstreamTimeout(f"scorer {self.name} timed out after {timeout_s:g}s") from None

    async def complete(self, call: Call) -> Completion:
        raise InvalidRequest(f"backend {self.name} scores options; it does not generate")

    async def open_stream(self, call: Call) -> ChunkStream:
        raise InvalidRequest(f"backend {self.name} scores options; it does not generate")


@register("gguf_scorer")
def _build(name: str, spec: Any) -> ScorerBackend:
    return ScorerBackend(name, spec)
