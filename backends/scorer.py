"""The ``gguf_scorer`` backend: the cascade's local tier, scoring options without generating.

It is a backend like the others (started and closed by the runtime, kept across reloads when
its spec is unchanged) but it serves no chat: a model that points at it fails validation, and
``complete`` refuses. Scoring runs in the file's worker process (``backends.engine_host``), one question at a
time per context.

Modes, chosen per tier: ``score`` (cloze: each option as a continuation of a prompt the
tier wrote) and ``score_question`` (lettered: the options listed with letters in the model's
chat template, read from the next token; reasoned: the same after a few sentences the model
writes; see ``backends.lettered``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from backends import gguf
from backends.base import Call, Capabilities, ChunkStream, Completion
from backends.engine_host import EngineHandle, EngineSpec, open_engine
from backends.engine_wire import question_to_wire, scores_from_wire
from backends.logprob import OptionScores
from backends.registry import register
from policies.cascade import Question
from policies.errors import InvalidRequest, UpstreamError, UpstreamTimeout


class ScorerBackend:
    capabilities = Capabilities(
        chat=False, completions=False, streaming=False, n_choices=False, tools=False, images=False, json_schema=False
    )

    def __init__(self, name: str, spec: Any) -> None:
        self.name = name
        self.spec = spec
        self.engine: EngineHandle | None = None

    async def start(self) -> None:
        path = await asyncio.to_thread(gguf.model_file, self.spec.gguf.package, self.spec.gguf.path)
        s = self.spec
        self.engine = EngineHandle(self.name, path, EngineSpec("scorer", s.n_ctx, s.n_threads, s.n_batch))
        await open_engine(self.engine)

    async def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.close()

    def healthy(self) -> bool:
        return self.engine is not None and self.engine.healthy()

    async def context_length(self, upstream: str) -> int | None:
        return int(self.spec.n_ctx)

    def problem(self) -> str | None:
        """Why the engine is down (``/ready`` shows it), None while it serves."""
        return None if self.engine is None else self.engine.problem()

    async def score(self, prompt: str, options: list[str], timeout_s: float) -> OptionScores:
        """Cloze: log P(option | prompt) per option."""
        return await self._run("score", {"prompt": prompt, "options": options}, timeout_s)

    async def score_question(self, question: Question, timeout_s: float, reason_tokens: int = 0) -> OptionScores:
        """Lettered: log P(label) per option, renormalised over the labels (one token each); with
        ``reason_tokens``, after the model has written up to that many (reasoned)."""
        args = {"question": question_to_wire(question), "reason_tokens": reason_tokens}
        return await self._run("score_question", args, timeout_s)

    async def _run(self, method: str, args: dict[str, Any], timeout_s: float) -> OptionScores:
        if self.engine is None:
            raise UpstreamError(f"scorer {self.name} is not loaded")
        try:
            return scores_from_wire(await self.engine.call(method, args, timeout_s))
        except UpstreamTimeout:
            raise UpstreamTimeout(f"scorer {self.name} timed out after {timeout_s:g}s") from None

    async def complete(self, call: Call) -> Completion:
        raise InvalidRequest(f"backend {self.name} scores options; it does not generate")

    async def open_stream(self, call: Call) -> ChunkStream:
        raise InvalidRequest(f"backend {self.name} scores options; it does not generate")


@register("gguf_scorer")
def _build(name: str, spec: Any) -> ScorerBackend:
    return ScorerBackend(name, spec)
