"""Every stream is counted (issue 51, part 1): a stream whose client did not ask for usage is
charged what the engine reported all the same (and the client gets no usage it did not ask for),
an engine that reports none is charged the estimate of what was relayed, and a limited key's
stream stops at its limit with an in-band error. Real gateways under uvicorn, scripted engines
that send usage only when asked (as vLLM and OpenAI do) or never (as llama.cpp's server)."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from gateway.service.keys.metering import CHECK_EVERY
from gateway.state.stores import MemoryStore
from policies import spend
from policies.fit import BYTES_PER_TOKEN, estimate, shape_of
from policies.schema import Prices
from tests.conftest import Gateway

KEY = "sk-metered"
PRICES = Prices(input_per_mtok=1000, output_per_mtok=2000)
WORDS = 40  # the scripted reply's words: its completion tokens, streamed a word a chunk
REPLY = " ".join(f"w{i}" for i in range(WORDS))
HI = [{"role": "user", "content": "say something long please"}]  # 4 prompt tokens (words)


def policy(limits: str = "", stream_usage: bool = True, words: int = WORDS) -> str:
    text = " ".join(f"w{i}" for i in range(words))
    return f"""version: 1
backends:
  say: {{type: scripted, text: "{text}", chunks: {words}, stream_usage: {str(stream_usage).lower()}}}
models:
  m: {{backend: say, prices: {{input_per_mtok: 1000, output_per_mtok: 2000}}}}
keys:
  - {{name: k, sha256: "{hashlib.sha256(KEY.encode()).hexdigest()}", limits: {{{limits}}}}}
"""


def events(gw: Gateway, path: str, body: dict[str, Any]) -> list[Any]:
    """The data of every server-sent event of one streamed request (``[DONE]`` as a string)."""
    out: list[Any] = []
    headers = {"authorization": f"Bearer {KEY}", "x-api-key": KEY}
    with httpx.stream("POST", gw.base_url + path, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def store(gw: Gateway) -> MemoryStore:
    s = gw.app.state.triage.holder.current.store  # type: ignore[attr-defined]
    assert isinstance(s, MemoryStore)
    return s


def recorded(gw: Gateway, wait_for: float = 0.0) -> tuple[float, int]:
    """The key's spend today and the tokens in its tpm window, once the spend reaches ``wait_for``
    (a request's count lands just after its answer)."""
    s, deadline = store(gw), time.monotonic() + 10
    while True:
        cost = sum(asyncio.run(s.spend("k", [spend.day(time.time())])).get(spend.day(time.time()), {}).values())
        tokens = sum(n for _, n in s._windows.get("tpm:k", ()))
        if cost >= wait_for - 1e-9 or time.monotonic() > deadline:
            return cost, tokens
        time.sleep(0.02)


def price(prompt: int, completion: int) -> float:
    return spend.cost(PRICES, {"prompt_tokens": prompt, "completion_tokens": completion})


def test_a_stream_that_did_not_ask_for_usage_is_counted_and_gets_none(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy("tpm: 100000"))
    got = events(gw, "/v1/chat/completions", {"model": "m", "messages": HI, "stream": True})
    assert got[-1] == "[DONE]" and all("usage" not in e for e in got[:-1])  # nothing it did not ask for
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in got[:-1]) == REPLY
    assert recorded(gw, price(4, WORDS)) == (pytest.approx(price(4, WORDS)), 4 + WORDS)  # the engine's own figures

    asked = {"model": "m", "messages": HI, "stream": True, "stream_options": {"include_usage": True}}
    got = events(gw, "/v1/chat/completions", asked)
    assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == WORDS
    assert recorded(gw, 2 * price(4, WORDS)) == (pytest.approx(2 * price(4, WORDS)), 2 * (4 + WORDS))

    done = events(gw, "/v1/completions", {"model": "m", "prompt": "say something long please", "stream": True})
    assert all("usage" not in e for e in done[:-1]) and "".join(e["choices"][0]["text"] for e in done[:-1]) == REPLY
    assert recorded(gw, 3 * price(4, WORDS)) == (pytest.approx(3 * price(4, WORDS)), 3 * (4 + WORDS))


def test_an_engine_that_reports_no_usage_is_charged_what_was_relayed(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy("tpm: 100000", stream_usage=False))
    asked = {"model": "m", "messages": HI, "stream": True, "stream_options": {"include_usage": True}}
    got = events(gw, "/v1/chat/completions", asked)
    assert all("usage" not in e for e in got[:-1])  # the engine sent none: none is made up for the client
    prompt = estimate(shape_of("chat", {"messages": HI}))
    completion = max(WORDS, math.ceil(len(REPLY.encode()) / BYTES_PER_TOKEN))
    assert recorded(gw, price(prompt, completion)) == (pytest.approx(price(prompt, completion)), prompt + completion)

    # the Responses API's final usage is the same estimate (it is counted the same way)
    out = events(gw, "/v1/responses", {"model": "m", "input": HI[0]["content"], "stream": True})
    usage = out[-1]["response"]["usage"]
    assert out[-1]["type"] == "response.completed" and usage["output_tokens"] == completion
    assert recorded(gw, 2 * price(prompt, completion))[0] == pytest.approx(2 * price(prompt, completion))


def test_a_limited_keys_stream_stops_at_its_tpm_in_band(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(f"tpm: {CHECK_EVERY + 8}", words=5 * CHECK_EVERY))
    got = events(gw, "/v1/chat/completions", {"model": "m", "messages": HI, "stream": True})
    text = [e for e in got[:-1] if "error" not in e]
    assert len(text) == 2 * CHECK_EVERY  # within the documented overshoot: one check's worth past the limit
    assert got[-2]["error"]["code"] == "rate_limit_exceeded" and got[-1] == "[DONE]"
    _, tokens = recorded(gw, price(4, 2 * CHECK_EVERY))
    assert tokens >= 2 * CHECK_EVERY  # what was relayed is counted (the cut stream's usage never came)
    r = httpx.post(
        gw.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": HI},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_limited_keys_stream_stops_at_its_budget_on_every_surface(gateway: Callable[..., Gateway]) -> None:
    budget = price(0, CHECK_EVERY + 8)  # spent within the stream's second check
    gw = gateway(policy(f"budget_per_day: {budget!r}", words=5 * CHECK_EVERY))
    got = events(gw, "/v1/chat/completions", {"model": "m", "messages": HI, "stream": True})
    assert got[-2]["error"]["code"] == "insufficient_quota"
    assert len([e for e in got[:-1] if "error" not in e]) == 2 * CHECK_EVERY
    # the key is now over its budget: every surface refuses it at the door
    for path, body in (
        ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),
        ("/v1/messages", {"model": "m", "max_tokens": 500, "messages": HI, "stream": True}),
    ):
        r = httpx.post(gw.base_url + path, json=body, headers={"authorization": f"Bearer {KEY}", "x-api-key": KEY})
        assert r.status_code == 429, (path, r.text)


def test_streams_on_every_surface_under_load_are_counted_exactly(gateway: Callable[..., Gateway]) -> None:
    """Limited keys (their streams counted as they go) streaming on the four surfaces at once: the
    spend and tokens recorded equal the engine's counts (no limit is reached, so no overshoot)."""
    gw = gateway(policy("tpm: 10000000, budget_per_day: 1000", words=3 * CHECK_EVERY + 5))
    words = 3 * CHECK_EVERY + 5
    calls = [
        ("/v1/chat/completions", {"model": "m", "messages": HI, "stream": True}),
        ("/v1/completions", {"model": "m", "prompt": HI[0]["content"], "stream": True}),
        ("/v1/responses", {"model": "m", "input": HI[0]["content"], "stream": True}),
        ("/v1/messages", {"model": "m", "max_tokens": 500, "messages": HI, "stream": True}),
    ] * 6
    with ThreadPoolExecutor(8) as pool:
        for got in pool.map(lambda c: events(gw, *c), calls):
            assert not any(isinstance(e, dict) and ("error" in e or e.get("type") == "error") for e in got)
    want = len(calls) * price(4, words)
    cost, tokens = recorded(gw, want)
    assert abs(cost - want) < 1e-9 and tokens == len(calls) * (4 + words)


def test_a_cached_answer_streamed_to_a_limited_key_counts_only_what_the_cache_charges(
    gateway: Callable[..., Gateway],
) -> None:
    """A response cache hit replayed as a stream is no engine's work: its chunks are not written to
    the key's tpm window or spend as they are relayed (the hit is charged the cache's share). Forty
    choices replay as more chunks than a checkpoint's worth."""
    gw = gateway(policy("tpm: 100000", words=4) + "response_cache: {ttl_s: 600, hit_charge: 0}\n")
    body = {"model": "m", "messages": HI, "temperature": 0, "n": 40}
    r = httpx.post(gw.base_url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and len(r.json()["choices"]) == 40
    counted = recorded(gw, price(4, 4))  # the scripted engine counts one choice's words
    assert counted == (pytest.approx(price(4, 4)), 8)
    time.sleep(0.2)  # the answer is kept off the request's path
    again = events(gw, "/v1/chat/completions", {**body, "stream": True})
    assert sum(1 for e in again[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")) == 40  # replayed
    time.sleep(0.2)
    assert recorded(gw) == counted  # nothing more written for the hit
