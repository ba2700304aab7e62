"""What the tiers ask: the scorer's prompts per type, the pool's request per engine family."""

from __future__ import annotations

from policies.cascade import YES_NO, Question
from policies.prompts import model_body, scorer_prompt
from policies.tiers import ModelTier, ScorerTier

CHOICE = Question("choice", "Which is a fruit?", ("car", "apple"), context="Think of food.")


def test_scorer_prompts_follow_the_templates() -> None:
    tier = ScorerTier(name="s", type="scorer", backend="b")
    prompt, options = scorer_prompt(tier, CHOICE)
    assert prompt == "Think of food.\n\nQuestion: Which is a fruit?\nAnswer:"
    assert options == [" car", " apple"]
    prompt, options = scorer_prompt(tier, Question("yes_no", "Is it?", YES_NO))
    assert prompt == "Question: Is it?\nAnswer (yes or no):" and options == [" yes", " no"]
    prompt, _ = scorer_prompt(tier, Question("score", "How good?", ("1", "2", "3"), scale=(1, 3)))
    assert prompt.endswith("(a number from 1 to 3):")


def test_pool_request_per_constraint() -> None:
    base = {"name": "pool", "type": "model", "model": "big"}
    body, labels = model_body(ModelTier(**base), CHOICE)
    assert labels == ("A", "B")
    assert "A. car\nB. apple" in body["messages"][0]["content"]
    assert body["logprobs"] is True and body["top_logprobs"] == 20 and body["temperature"] == 0.0
    assert "guided_choice" not in body and "structured_outputs" not in body
    assert model_body(ModelTier(**base, constrain="guided_choice"), CHOICE)[0]["guided_choice"] == ["A", "B"]
    assert model_body(ModelTier(**base, constrain="structured_outputs"), CHOICE)[0]["structured_outputs"] == {
        "choice": ["A", "B"]
    }
    assert model_body(ModelTier(**base, constrain="regex"), Question("yes_no", "?", YES_NO))[0]["regex"] == "(yes|no)"
    scale = Question("score", "How good?", ("1", "2", "3", "4", "5"), scale=(1, 5))
    assert model_body(ModelTier(**base, constrain="structured_outputs"), scale)[0]["structured_outputs"] == {
        "regex": "(1|2|3|4|5)"
    }
    numeric, labels = model_body(ModelTier(**base, constrain="guided_choice"), Question("score", "6 * 7?", ()))
    assert labels == () and "guided_choice" not in numeric and "logprobs" not in numeric
    assert numeric["max_tokens"] == 512 and "Answer:" in numeric["messages"][0]["content"]
