"""The jailbreak guardrail on a real gateway: the shipped head on the encoder's reading of the last
user turn (the reading the router then reuses: one encoder pass per request), refused with a 400
naming the guardrail on chat, Responses and Anthropic's Messages; logged only where its action says
so; an ordinary prompt routed as before."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from benchmarks.guardrail_data import JAILBREAK_FILE
from classifiers.jailbreak import SHIPPED_HEADS
from tests import lanes
from tests.conftest import Gateway


@pytest.fixture(scope="session")
@lanes.model
def shipped_heads() -> Path:
    """The embedded default's heads (the jailbreak head among them), over the exported encoder."""
    from classifiers.training.export import ensure_exported

    ensure_exported()
    return SHIPPED_HEADS


def attack(source: str = "dan") -> str:
    with gzip.open(JAILBREAK_FILE, "rt", encoding="utf-8") as f:
        return next(r["text"] for r in map(json.loads, f) if r["source"] == source)


def policy(heads: Path, action: str = "refuse") -> str:
    return f"""version: 1
classifier:
  artifacts: {heads}
  encoder: {{precision: int8, threads: 1, batch_max_wait_ms: 0}}
  heads: [question_type, category, injection]
backends:
  s: {{type: scripted, text: "fine"}}
models:
  m: {{backend: s}}
virtual_models:
  routed: {{type: semantic, default: m, min_confidence: 0.5, escalate_to: m, unfamiliar: m, injection: m}}
guardrails:
  checks:
    jb: {{type: jailbreak, action: {action}}}
"""


def test_a_jailbreak_is_refused_naming_the_guardrail_on_every_surface(
    gateway: Callable[..., Gateway], shipped_heads: Path
) -> None:
    gw = gateway(policy(shipped_heads))
    text = attack()
    with pytest.raises(openai.BadRequestError) as err:
        gw.client().chat.completions.create(model="routed", messages=[{"role": "user", "content": text}])
    assert isinstance(err.value.body, dict)
    assert err.value.body["guardrail"] == "jb" and err.value.body["code"] == "guardrail_refused"
    with pytest.raises(openai.BadRequestError) as err:
        gw.client().responses.create(model="routed", input=text, stream=True)
    assert "'jb'" in err.value.message
    claude = anthropic.Anthropic(base_url=gw.base_url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as aerr:
        claude.messages.create(model="routed", max_tokens=16, messages=[{"role": "user", "content": attack("giskard")}])
    assert "'jb'" in str(aerr.value)
    claude.close()
    metrics = httpx.get(gw.base_url + "/metrics").text
    assert 'triage_guardrail_hits_total{action="refuse",guardrail="jb"} 3.0' in metrics


def test_an_ordinary_prompt_is_routed_on_the_one_reading_the_guardrail_made(
    gateway: Callable[..., Gateway], shipped_heads: Path
) -> None:
    gw = gateway(policy(shipped_heads))
    rt = gw.app.state.triage.holder.current  # type: ignore[attr-defined]
    asks = [
        "What is the capital of France?",
        "Write a haiku about autumn leaves.",
        "How do I reverse a list in Python?",
    ]
    for i, ask in enumerate(asks, start=1):
        r = gw.client().chat.completions.with_raw_response.create(
            model="routed", messages=[{"role": "user", "content": ask}]
        )
        assert r.parse().choices[0].message.content == "fine" and r.headers["x-triage-model"] == "m"
        assert "x-triage-route" in r.headers
        assert rt.encoding.batcher.stats.items == i  # the guardrail's read, reused by the router


def test_action_log_lets_the_request_through(gateway: Callable[..., Gateway], shipped_heads: Path) -> None:
    gw = gateway(policy(shipped_heads, "log"))
    out = gw.client().chat.completions.create(model="routed", messages=[{"role": "user", "content": attack()}])
    assert out.choices[0].message.content == "fine"
    assert 'triage_guardrail_hits_total{action="log",guardrail="jb"} 1.0' in httpx.get(gw.base_url + "/metrics").text
