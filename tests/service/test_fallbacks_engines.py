"""A real context overflow on llama.cpp's server and on vLLM takes the model's context_window
fallback (`fallbacks_on`), read from each engine's own answer. The prompt is one that the
gateway's own estimate (bytes / 3) lets through and the engine's tokenizer does not: single
letters, one token each."""

from __future__ import annotations

from collections.abc import Callable

from tests.conftest import Gateway, LlamaServer, VllmServer

PROMPT = "a " * 2500  # 5,000 bytes: about 1,700 tokens by the estimate, about 2,500 by SmolLM2's tokenizer


def overflow_policy(api_base: str) -> str:
    return f"""version: 1
backends:
  engine: {{type: openai, replicas: [{{api_base: "{api_base}"}}], health: {{enabled: false}}, retries: {{attempts: 1}},
           error_text: scrubbed}}
  spare: {{type: scripted, text: "from the model with the longer window"}}
models:
  smollm2: {{backend: engine, fallbacks_on: {{context_window: [long]}}}}
  long: {{backend: spare}}
"""


def test_a_real_llama_cpp_overflow_takes_the_context_window_fallback(
    gateway: Callable[..., Gateway], llama_server: LlamaServer
) -> None:
    overflows_to_the_fallback(gateway(overflow_policy(llama_server.api_base)))


def test_a_real_vllm_overflow_takes_the_context_window_fallback(
    gateway: Callable[..., Gateway], vllm_server: VllmServer
) -> None:
    overflows_to_the_fallback(gateway(overflow_policy(vllm_server.api_base)))


def overflows_to_the_fallback(gw: Gateway) -> None:
    with gw.http() as http:
        r = http.post(
            "/v1/chat/completions",
            json={"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": PROMPT}]},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-triage-model"] == "long"
        assert r.headers["x-triage-fallbacks"] == "smollm2 (context_window)"
        short = http.post(
            "/v1/chat/completions",
            json={"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Say hi."}]},
        )
    assert short.status_code == 200 and short.headers["x-triage-model"] == "smollm2"  # no fallback when it fits
