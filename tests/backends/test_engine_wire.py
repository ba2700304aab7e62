"""The pipe between the gateway and an engine's worker process (``backends.engine_wire``): what
crosses it comes back as it was, and a job that cannot cross fails alone while the host reads on."""

from __future__ import annotations

from typing import Any

import pytest

from backends.gguf import smollm2_path


def test_the_engine_wire_survives_what_it_carries() -> None:
    """Questions and scores cross the pipe as they were."""
    from backends.engine_wire import question_from_wire, question_to_wire, scores_from_wire, scores_to_wire
    from backends.lettered import LetteredScores
    from policies.cascade import Question

    q = Question(type="score", question="How hot?", options=("1", "2", "3"), context="c", task="t", scale=(1, 3))
    assert question_from_wire(question_to_wire(q)) == q
    s = LetteredScores((-0.1, -2.3), (1, 1), 40, 12, label_mass=0.9, generated_tokens=5, reasoning="because")
    assert scores_from_wire(scores_to_wire(s)) == s


@pytest.mark.engine
def test_a_job_that_cannot_cross_the_pipe_is_a_400_and_the_host_reads_on() -> None:
    """Arguments the wire cannot carry (a lone surrogate, which a program's str may hold) fail that
    job alone: the host keeps reading the worker's replies, and the next job is answered."""
    import asyncio

    from backends.base import Call
    from backends.engine_handle import EngineHandle
    from backends.engine_host import EngineSpec
    from backends.llamacpp import _kwargs
    from policies.errors import InvalidRequest

    def args(text: str) -> dict[str, Any]:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        return _kwargs(Call("chat", body, "wire"))

    async def main() -> Any:
        handle = EngineHandle("wire", smollm2_path(), EngineSpec("chat", 512, 1, 512))
        await handle.open()
        try:
            with pytest.raises(InvalidRequest, match="cannot be sent to local model"):
                await handle.call("chat", args("hi \ud800"), 30)
            return await handle.call("chat", args("hi"), 30)
        finally:
            await handle.host.stop()

    out = asyncio.run(main())
    assert out["choices"][0]["message"]["role"] == "assistant"
