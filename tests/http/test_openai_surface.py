"""The official openai client against triage under uvicorn, with a real llama.cpp server as
the pool: chat and completions, plain and streamed, models, parameters passed through."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conftest import Gateway, LlamaServer

MSG = [{"role": "user", "content": "Say hello."}]


def pool_policy(*api_bases: str, extra: str = "") -> str:
    replicas = "".join(f"      - api_base: {b}\n" for b in api_bases)
    return f"""version: 1
backends:
  pool:
    type: openai
    replicas:
{replicas}    retries: {{attempts: 3, backoff_s: 0.01}}
    health: {{interval_s: 0.5, cooldown_s: 30}}
    timeouts: {{first_byte_s: 60}}
models:
  smollm2:
    backend: pool
virtual_models:
  auto: {{type: alias, targets: [smollm2]}}
{extra}"""


@pytest.fixture
def gw(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> Gateway:
    return gateway(pool_policy(llama_server.api_base))


def test_chat_completion(gw: Gateway) -> None:
    out = gw.client().chat.completions.create(model="smollm2", messages=MSG, max_tokens=8, temperature=0, seed=1)
    assert out.object == "chat.completion"
    assert out.model == "smollm2"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.usage.completion_tokens <= 8
    assert out.usage.prompt_tokens > 0


def test_parameters_reach_the_engine(gw: Gateway) -> None:
    client = gw.client()
    story = [{"role": "user", "content": "Write a long story, at least 300 words, about a dragon."}]
    short = client.chat.completions.create(model="smollm2", messages=story, max_tokens=2, temperature=0)
    assert short.usage.completion_tokens <= 2 and short.choices[0].finish_reason == "length"
    a = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=12, temperature=0)
    b = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=12, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    lp = client.chat.completions.create(
        model="smollm2", messages=MSG, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    assert lp.choices[0].logprobs is not None
    assert len(lp.choices[0].logprobs.content[0].top_logprobs) == 2
    raw = client.chat.completions.with_raw_response.create(model="auto", messages=MSG, max_tokens=2, user="u1")
    assert raw.headers["x-triage-model"] == "smollm2"
    assert raw.headers["x-triage-backend"] == "pool"
    assert raw.headers["x-request-id"]


def test_chat_stream(gw: Gateway) -> None:
    stream = gw.client().chat.completions.create(
        model="smollm2", messages=MSG, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert all(c.model == "smollm2" for c in chunks)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals in (["length"], ["stop"])
    # llama-cpp-python's server ignores include_usage (vLLM and SGLang honour it); triage passes
    # the option through and does not invent counts. Streamed usage is tested on the local backend.


def test_text_completion_plain_and_streamed(gw: Gateway) -> None:
    client = gw.client()
    out = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0, stop=["\n"]
    )
    assert out.object == "text_completion"
    assert out.choices[0].text is not None
    assert out.usage.prompt_tokens > 0
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0, stop=["\n"], stream=True
        )
        if c.choices
    )
    assert streamed == out.choices[0].text


def test_models_and_probes(gw: Gateway) -> None:
    assert [m.id for m in gw.client().models.list()] == ["smollm2", "auto"]
    assert gw.client().models.retrieve("auto").id == "auto"
    with gw.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/ready").json() == {"status": "ready", "backends": {"pool": True}}


def test_engine_rejection_passes_through_as_4xx(gw: Gateway) -> None:
    import openai

    with pytest.raises(openai.BadRequestError):  # the engine refuses a prompt over its context
        gw.client().completions.create(model="smollm2", prompt="word " * 5000, max_tokens=1)
    assert gw.client().chat.completions.create(model="smollm2", messages=MSG, max_tokens=1).choices
