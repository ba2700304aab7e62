"""litellm as a client of triage: its ``anthropic/`` provider against ``/v1/messages`` and its
``openai/`` provider against ``/v1/responses``, plain and streamed, on a real llama.cpp engine;
triage's errors reaching litellm as its own exception classes."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import pytest
import structlog

# before litellm is imported: its bundled cost map and beta-header lists, nothing fetched
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")
import litellm

from tests.conftest import Gateway, LlamaServer
from tests.http.test_openai_surface import pool_policy

litellm.suppress_debug_info = True
# pydantic's notes on litellm's own TypedDicts are ignored for every test (pyproject.toml)

KEY = "sk-litellm-client"
# What a test may assume of greedy text (docs/architecture.md, tests): a limit no answer finishes
# within (a story of 300 words in 16 tokens: SmolLM2's runs past 400), or one every answer finishes
# well within (a greeting in 128 tokens: 23 written on AMD EPYC with AVX-512 VNNI, 2026-12-07),
# never one model's phrasing of a short answer on one CPU kind (issue 50: "Count from one to
# twenty." in 16 tokens was incomplete on AVX-512 and completed in 14 on AVX2).
STORY = [{"role": "user", "content": "Write a long story, at least 300 words, about a dragon who learns to read."}]
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
ROOM = 128  # tokens a greeting ends well within
SCRIPTED = f"""version: 1
backends:
  cheap: {{type: scripted, text: "fine thanks"}}
models:
  cheap: {{backend: cheap}}
keys:
  - {{name: app, sha256: {hashlib.sha256(KEY.encode()).hexdigest()}}}
  - {{name: slow, sha256: {hashlib.sha256(b"sk-one-a-minute").hexdigest()}, limits: {{rpm: 1}}}}
"""


@pytest.fixture
def engine(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> Gateway:
    return gateway(pool_policy(llama_server.api_base))


@pytest.fixture
def scripted(gateway: Callable[..., Gateway]) -> Gateway:
    return gateway(SCRIPTED)


def messages(gw: Gateway, model: str, key: str = "none", **kwargs: Any) -> Any:
    """litellm's ``anthropic/`` provider: the base URL without ``/v1``, as for Anthropic's own client."""
    return litellm.completion(
        model=f"anthropic/{model}", api_base=gw.base_url, api_key=key, num_retries=0, max_retries=0, **kwargs
    )


def responses(gw: Gateway, model: str, key: str = "none", **kwargs: Any) -> Any:
    """litellm's ``openai/`` provider on the Responses API: the base URL with ``/v1``."""
    return litellm.responses(
        model=f"openai/{model}", api_base=gw.base_url + "/v1", api_key=key, num_retries=0, max_retries=0, **kwargs
    )


@pytest.fixture
def streams_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    """litellm fakes a Responses stream for a model it has no entry for (one plain request, the
    events made up on the client); an entry for it makes litellm ask triage for the stream."""
    for model in ("smollm2", "cheap", "nope"):
        monkeypatch.setitem(litellm.model_cost, f"openai/{model}", {"litellm_provider": "openai", "mode": "responses"})


def test_anthropic_provider_a_message_from_the_engine(engine: Gateway) -> None:
    out = messages(engine, "smollm2", messages=STORY, max_tokens=4, temperature=0)
    assert out.model == "smollm2" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.choices[0].finish_reason == "length"  # Anthropic's max_tokens, in litellm's words
    assert out.usage.completion_tokens == 4 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 4
    brief = messages(engine, "smollm2", messages=HELLO, max_tokens=ROOM, temperature=0)
    assert brief.choices[0].finish_reason == "stop"  # end_turn
    assert 0 < brief.usage.completion_tokens < ROOM and brief.usage.prompt_tokens > 0


def test_anthropic_provider_a_streamed_message_from_the_engine(engine: Gateway) -> None:
    plain = messages(engine, "smollm2", messages=STORY, max_tokens=4, temperature=0)
    with structlog.testing.capture_logs() as logs:
        chunks = list(
            messages(
                engine,
                "smollm2",
                messages=STORY,
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert [e["stream"] for e in logs if e["event"] == "request"] == [True]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    # no usage to check here: llama-cpp-python's server reports none in streams (the scripted engine does, below)


def test_openai_provider_a_response_from_the_engine(engine: Gateway) -> None:
    # litellm raises max_output_tokens to 16, OpenAI's least: a story cannot end within it
    out = responses(engine, "smollm2", input=STORY, max_output_tokens=16, temperature=0)
    assert out.object == "response" and out.model == "smollm2"
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].type == "message" and out.output[0].content[0].text
    assert out.usage.output_tokens == 16 and out.usage.input_tokens > 0
    assert out.usage.total_tokens == out.usage.input_tokens + 16
    brief = responses(
        engine, "smollm2", input=HELLO[1:], instructions="Be brief.", max_output_tokens=ROOM, temperature=0
    )
    assert brief.status == "completed" and brief.incomplete_details is None and brief.instructions == "Be brief."
    assert 0 < brief.usage.output_tokens < ROOM and brief.usage.input_tokens > 0


# litellm's own: it prices a copy of the final response with the usage in chat's shape, and pydantic
# warns when its logging dumps that copy (the usage triage sends is in the Responses shape)
LITELLM_PRICED_COPY = "ignore:Pydantic serializer warnings:UserWarning"


@pytest.mark.usefixtures("streams_natively")
@pytest.mark.filterwarnings(LITELLM_PRICED_COPY)
def test_openai_provider_a_streamed_response_from_the_engine(engine: Gateway) -> None:
    # asked twice before the stream: the engine's prompt cache then holds the prompt for the answer
    # compared as for the stream (on AVX2, a greedy answer from a cached prefix may differ from a
    # cold one after a few words: the kernels sum in another order)
    responses(engine, "smollm2", input=STORY, max_output_tokens=16, temperature=0)
    plain = responses(engine, "smollm2", input=STORY, max_output_tokens=16, temperature=0)
    with structlog.testing.capture_logs() as logs:
        events = list(responses(engine, "smollm2", input=STORY, max_output_tokens=16, temperature=0, stream=True))
    assert [e["stream"] for e in logs if e["event"] == "request"] == [True]
    kinds = [str(e.type.value) for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    text = "".join(e.delta for e, kind in zip(events, kinds, strict=True) if kind == "response.output_text.delta")
    assert text == plain.output[0].content[0].text
    final = events[-1].response
    assert final.output[0].content[0].text == text and final.incomplete_details.reason == "max_output_tokens"


@pytest.mark.usefixtures("streams_natively")
@pytest.mark.filterwarnings(LITELLM_PRICED_COPY)
def test_usage_in_streams_from_an_engine_that_reports_it(scripted: Gateway) -> None:
    hi = [{"role": "user", "content": "hi"}]
    chunks = list(
        messages(scripted, "cheap", KEY, messages=hi, max_tokens=8, stream=True, stream_options={"include_usage": True})
    )
    built = litellm.stream_chunk_builder(chunks)
    assert built.choices[0].message.content == "fine thanks" and built.choices[0].finish_reason == "stop"
    assert built.usage.completion_tokens == 2 and built.usage.prompt_tokens > 0
    final = list(responses(scripted, "cheap", KEY, input="hi", stream=True))[-1].response
    assert final.status == "completed" and final.output[0].content[0].text == "fine thanks"
    assert final.usage.output_tokens == 2 and final.usage.input_tokens > 0


@pytest.mark.usefixtures("streams_natively")
@pytest.mark.parametrize("stream", [False, True])
def test_triages_errors_are_litellms_exception_classes(scripted: Gateway, stream: bool) -> None:
    hi = [{"role": "user", "content": "hi"}]

    def both(model: str, key: str) -> list[Callable[[], object]]:
        return [
            lambda: (
                list(messages(scripted, model, key, messages=hi, max_tokens=8, stream=True))
                if stream
                else messages(scripted, model, key, messages=hi, max_tokens=8)
            ),
            lambda: (
                list(responses(scripted, model, key, input="hi", stream=True))
                if stream
                else responses(scripted, model, key, input="hi")
            ),
        ]

    for call in both("cheap", "sk-wrong"):
        with pytest.raises(litellm.AuthenticationError) as bad_key:
            call()
        assert bad_key.value.status_code == 401
    for call in both("nope", KEY):
        with pytest.raises(litellm.NotFoundError) as missing:
            call()
        assert missing.value.status_code == 404 and "nope" in missing.value.message
    first, *rest = both("cheap", "sk-one-a-minute")
    first()  # the key's one request a minute
    for call in [first, *rest]:
        with pytest.raises(litellm.RateLimitError) as limited:
            call()
        assert limited.value.status_code == 429
