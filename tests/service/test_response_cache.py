"""The response cache for open requests (issue 33): the same reproducible request is answered from
the cache, on every surface, whole or streamed in the surface's own events; what may not be
cached is passed through and said so; keys do not see each other's answers; a reload invalidates;
two gateways on one Redis share their hits. Official clients against a real uvicorn."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from gateway.service.cache import response as response_cache
from policies import response_cache as rules
from policies.schema import ResponseCacheSpec
from tests.conftest import SHARED_DATA, Gateway

CACHE = "response_cache: {ttl_s: 600}\n"


def policy(extra: str = CACHE, text: str = "a kept answer", state: str = "{store: memory}") -> str:
    return f"""version: 1
backends:
  script: {{type: scripted, text: "{text}", latency_s: 0.05, chunks: 3}}
models:
  scripted: {{backend: script, prices: {{input_per_mtok: 1000, output_per_mtok: 2000}}}}
virtual_models:
  auto: {{type: alias, targets: [scripted]}}
state: {state}
{extra}"""


def engine_calls(gw: Gateway) -> int:
    return int(gw.app.state.triage.holder.current.backends["script"].calls)  # type: ignore[attr-defined]


MSG = [{"role": "user", "content": "what is kept?"}]
ZERO = {"temperature": 0}  # this anthropic client takes no `temperature` argument


def test_the_same_reproducible_request_is_a_hit_and_asks_no_engine(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    client = gw.client()
    first = client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0)
    assert first.headers["x-triage-cache"] == "miss" and engine_calls(gw) == 1
    second = client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0)
    assert second.headers["x-triage-cache"] == "hit" and second.headers["x-triage-cache-match"] == "exact"
    assert second.headers["x-triage-backend"] == "cache" and second.headers["x-triage-model"] == "scripted"
    assert engine_calls(gw) == 1
    a, b = first.parse(), second.parse()
    assert a.choices[0].message.content == b.choices[0].message.content == "a kept answer"
    assert a.id != b.id and b.model == "scripted"
    assert float(first.headers["x-triage-cost"]) > 0 and float(second.headers["x-triage-cost"]) == 0
    # a seed makes it reproducible too; another field that decides the answer is another entry
    for other in ({"seed": 7}, {"temperature": 0, "max_tokens": 5}, {"temperature": 0, "tools": None}):
        fields: dict[str, Any] = {k: v for k, v in other.items() if v is not None}
        r = client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, **fields)
        assert r.headers["x-triage-cache"] == ("miss" if other != {"temperature": 0, "tools": None} else "hit"), other
    # fields that only say how to deliver it are not in the key
    r = client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0, user="u")
    assert r.headers["x-triage-cache"] == "hit"
    metrics = httpx.get(f"{gw.base_url}/metrics").text
    assert 'triage_response_cache_total{result="hit"}' in metrics
    assert "triage_response_cache_saved_total" in metrics


def test_a_stream_is_kept_and_replayed_in_each_surfaces_events(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    client = gw.client()
    streamed = client.chat.completions.create(
        model="scripted", messages=MSG, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == "a kept answer" and engine_calls(gw) == 1
    # the streamed answer was kept whole: a request for the whole answer hits it
    whole = client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0)
    assert whole.headers["x-triage-cache"] == "hit" and whole.parse().choices[0].message.content == text
    assert whole.parse().usage is not None and whole.parse().usage.completion_tokens == 3
    # and a streamed one is replayed as chunks, the usage last where asked for
    with client.chat.completions.with_streaming_response.create(
        model="scripted", messages=MSG, temperature=0, stream=True, stream_options={"include_usage": True}
    ) as r:
        assert r.headers["x-triage-cache"] == "hit"
        chunks = list(r.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    # the Responses API and Messages are chat bodies by the time they are keyed: the same entry
    resp = client.responses.with_raw_response.create(model="scripted", input="what is kept?", temperature=0)
    assert resp.headers["x-triage-cache"] == "hit" and resp.parse().output_text == text
    events = list(client.responses.create(model="scripted", input="what is kept?", temperature=0, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == text
    claude = anthropic.Anthropic(base_url=gw.base_url, api_key="none", max_retries=0)
    try:
        msg = claude.messages.with_raw_response.create(
            model="scripted", max_tokens=64, extra_body=ZERO, messages=[{"role": "user", "content": "what is kept?"}]
        )
        with claude.messages.stream(
            model="scripted", max_tokens=64, extra_body=ZERO, messages=[{"role": "user", "content": "what is kept?"}]
        ) as s:
            streamed_text = s.get_final_text()
    finally:
        claude.close()
    assert msg.headers["x-triage-cache"] in ("hit", "miss")  # max_tokens is a field of its own: its own entry
    assert msg.parse().content[0].text == text and streamed_text == text  # type: ignore[union-attr]
    assert engine_calls(gw) == 2  # the Messages request's first ask only


def test_what_is_not_cached_is_passed_through_and_said(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy())
    client = gw.client()
    sampled = client.chat.completions.with_raw_response.create(model="scripted", messages=MSG)
    assert sampled.headers["x-triage-cache"] == "bypass"
    assert "temperature 0 or seed" in sampled.headers["x-triage-cache-bypass"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}}]}]
    r = client.chat.completions.with_raw_response.create(model="scripted", messages=image, temperature=0)  # type: ignore[arg-type]
    assert r.headers["x-triage-cache"] == "bypass" and r.headers["x-triage-cache-bypass"] == "an image by URL"
    # the request's own say: allow (a sampled request accepts a kept answer), refresh, bypass
    calls = engine_calls(gw)
    allow = {"x-triage-cache": "allow"}
    assert (
        client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, extra_headers=allow).headers[
            "x-triage-cache"
        ]
        == "miss"
    )
    assert (
        client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, extra_headers=allow).headers[
            "x-triage-cache"
        ]
        == "hit"
    )
    refresh = client.chat.completions.with_raw_response.create(
        model="scripted", messages=MSG, extra_headers={"x-triage-cache": "refresh"}, temperature=0
    )
    assert refresh.headers["x-triage-cache"] == "miss"
    bypass = client.chat.completions.with_raw_response.create(
        model="scripted", messages=MSG, extra_headers={"x-triage-cache": "bypass"}, temperature=0
    )
    assert bypass.headers["x-triage-cache"] == "bypass"
    assert engine_calls(gw) == calls + 3
    # a policy without a response cache says nothing
    plain = gateway(policy(extra=""))
    assert (
        "x-triage-cache"
        not in plain.client()
        .chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0)
        .headers
    )


KEYS = """keys:
  - {name: alice, sha256: %s}
  - {name: bob, sha256: %s, models: [scripted]}
"""


def test_a_key_never_gets_an_answer_made_for_another_unless_shared(gateway: Callable[..., Gateway]) -> None:
    import hashlib

    digest = {k: hashlib.sha256(k.encode()).hexdigest() for k in ("alice-key", "bob-key")}
    keys = KEYS % (digest["alice-key"], digest["bob-key"])
    for scope, shared in (("key", False), ("shared", True)):
        gw = gateway(policy(extra=f"response_cache: {{scope: {scope}}}\n" + keys))
        a, b = gw.client("alice-key"), gw.client("bob-key")
        assert (
            a.chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0).headers[
                "x-triage-cache"
            ]
            == "miss"
        )
        seen = b.chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0)
        assert seen.headers["x-triage-cache"] == ("hit" if shared else "miss"), scope
        # a model the key may not ask is refused before the cache is read (403), shared or not
        with pytest.raises(Exception) as caught:
            b.chat.completions.create(model="auto", messages=MSG, temperature=0)
        assert getattr(caught.value, "status_code", None) == 403


def test_a_hit_charged_a_share_of_its_price_shows_in_spend(gateway: Callable[..., Gateway]) -> None:
    import hashlib

    admin = hashlib.sha256(b"admin").hexdigest()
    key = hashlib.sha256(b"k").hexdigest()
    extra = (
        f"response_cache: {{hit_charge: 0.25}}\nkeys:\n  - {{name: k, sha256: {key}}}\naccess: {{admin_key: {admin}}}\n"
    )
    gw = gateway(policy(extra=extra))
    client = gw.client("k")
    miss = client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0)
    hit = client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0)
    assert float(hit.headers["x-triage-cost"]) == pytest.approx(float(miss.headers["x-triage-cost"]) * 0.25)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        rows = httpx.get(f"{gw.base_url}/admin/spend", headers={"authorization": "Bearer admin"}).json()
        models = {r["model"]: r["cost"] for k in rows["keys"] for r in k["days"]}
        if "cache:scripted" in models:
            break
        time.sleep(0.05)
    assert models["cache:scripted"] == pytest.approx(float(hit.headers["x-triage-cost"]))
    assert models["scripted"] == pytest.approx(float(miss.headers["x-triage-cost"]))


def test_a_reload_never_serves_old_entries(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(), watch=True)
    client = gw.client()
    client.chat.completions.create(model="scripted", messages=MSG, temperature=0)
    assert (
        client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0).headers[
            "x-triage-cache"
        ]
        == "hit"
    )
    time.sleep(0.3)  # let the watcher start
    gw.policy_path.write_text(policy(text="another answer"))
    deadline = time.monotonic() + 10
    applied = 'triage_policy_reloads_total{outcome="applied"} 1.0'
    while applied not in httpx.get(f"{gw.base_url}/metrics").text and time.monotonic() < deadline:
        time.sleep(0.1)
    after = client.chat.completions.with_raw_response.create(model="scripted", messages=MSG, temperature=0)
    assert after.headers["x-triage-cache"] == "miss" and after.parse().choices[0].message.content == "another answer"


def test_two_gateways_on_one_redis_share_hits(redis_url: str, gateways: Callable[[str, int], list[str]]) -> None:
    state = f'{{store: redis, url: "{redis_url}", prefix: "t-answers"}}'
    first, second = gateways(policy(state=state), 2)
    body = {"model": "scripted", "messages": MSG, "temperature": 0}
    a = httpx.post(f"{first}/v1/chat/completions", json=body, timeout=30)
    assert a.headers["x-triage-cache"] == "miss"
    b = until_hit(f"{second}/v1/chat/completions", body)  # kept off the first request's path: a moment later
    assert a.json()["choices"] == b.json()["choices"]
    # a stream made on one, replayed by the other
    streamed = {**body, "messages": [{"role": "user", "content": "another"}], "stream": True}
    with httpx.stream("POST", f"{second}/v1/chat/completions", json=streamed, timeout=30) as r:
        assert r.headers["x-triage-cache"] == "miss"
        r.read()
    until_hit(f"{first}/v1/chat/completions", {**streamed, "stream": False})


def until_hit(url: str, body: dict[str, Any], within_s: float = 5.0) -> httpx.Response:
    deadline = time.monotonic() + within_s
    while True:
        r = httpx.post(url, json=body, timeout=30)
        if r.headers["x-triage-cache"] == "hit" or time.monotonic() > deadline:
            assert r.headers["x-triage-cache"] == "hit", r.headers
            return r
        time.sleep(0.05)


# --- the pure rules ------------------------------------------------------------------------------------------


def test_a_stream_assembled_and_replayed_is_the_same_answer_with_tool_calls() -> None:
    whole = {
        "id": "x",
        "created": 1,
        "model": "m",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "let me look",
                    "reasoning_content": "a thought",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}},
                        {"id": "c2", "type": "function", "function": {"name": "put", "arguments": "{}"}},
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }
    chunks = rules.replay("chat", whole, usage=True)
    assert rules.assemble("chat", chunks) == whole
    # an engine's stream, its arguments in pieces
    pieces = [
        {"id": "x", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    got = rules.assemble("chat", pieces)
    assert got is not None and got["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    # unfinished: not an answer to keep
    assert rules.assemble("chat", pieces[:-1]) is None
    text = {"id": "t", "created": 1, "model": "m", "choices": [{"index": 0, "text": "abc", "finish_reason": "stop"}]}
    assert rules.assemble("completion", rules.replay("completion", text, usage=False)) == {
        **text,
        "object": "text_completion",
    }


def test_the_key_and_its_context() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
    k = rules.key("v1", "alice", "chat", body)
    assert k == rules.key("v1", "alice", "chat", {**body, "stream": True, "user": "x", "metadata": {"a": "b"}})
    assert k != rules.key("v2", "alice", "chat", body) != rules.key("v1", "bob", "chat", body)
    assert k != rules.key("v1", "alice", "chat", {**body, "temperature": 0.5})
    other_q = {**body, "messages": [body["messages"][0], {"role": "user", "content": "another"}]}
    other_sys = {**body, "messages": [{"role": "system", "content": "t"}, body["messages"][1]]}
    ctx = rules.context_key("v1", "alice", "chat", body)
    assert ctx == rules.context_key("v1", "alice", "chat", other_q)  # the last user turn is not the context
    assert ctx != rules.context_key("v1", "alice", "chat", other_sys)
    assert rules.last_user_text(other_q) == "another"
    spec = ResponseCacheSpec()
    assert not rules.verdict(spec, "chat", body, None).read
    assert rules.verdict(spec, "chat", {**body, "temperature": 0}, None).read
    assert rules.verdict(ResponseCacheSpec(when="always"), "chat", body, None).read
    assert rules.directive(" Refresh ") == "refresh" and rules.directive("other") is None


def test_an_entry_that_does_not_read_is_a_miss() -> None:
    from types import SimpleNamespace

    lookup = response_cache.Lookup(
        SimpleNamespace(),
        ResponseCacheSpec(),
        "chat",
        "k",
        True,
        True,
        response_cache.Note("miss"),  # type: ignore[arg-type]
    )
    for raw in (b"not json", b'{"model": "m"}', b'{"model": "m", "body": {"choices": "x"}}'):
        assert lookup._read(raw) is None


# --- the semantic cache ---------------------------------------------------------------------------------------


def semantic_policy(heads: Path, state: str = "{store: memory}", rule: str = "{kind: global, similarity: 0.8}") -> str:
    return f"""version: 1
classifier:
  data_dir: {SHARED_DATA}
  artifacts: {heads}
  heads: [question_type, category, reasoning, injection]
backends:
  script: {{type: scripted, text: "a kept answer", latency_s: 0.05}}
models:
  scripted: {{backend: script}}
  other: {{backend: script}}
state: {state}
response_cache:
  semantic: {{models: [scripted], rule: {rule}, audit_share: 0}}
"""


def ask(url: str, question: str, model: str = "scripted", system: str | None = None) -> httpx.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_a_similar_question_in_the_same_context_gets_the_kept_answer(
    gateway: Callable[..., Gateway], trained_heads: Path
) -> None:
    gw = gateway(semantic_policy(trained_heads))
    assert ask(gw.base_url, "How do I reset my password?").headers["x-triage-cache"] == "miss"
    time.sleep(0.3)  # the entry is made off the request's path
    similar = ask(gw.base_url, "how can I reset my password")
    assert similar.headers["x-triage-cache"] == "hit", similar.headers
    match = similar.headers["x-triage-cache-match"].split()
    assert match[0] == "semantic" and 0.8 <= float(match[1]) < 1.0
    assert similar.json()["choices"][0]["message"]["content"] == "a kept answer"
    # another question, another context (a system prompt), another model: none of them
    assert ask(gw.base_url, "What will the weather be in Paris tomorrow?").headers["x-triage-cache"] == "miss"
    assert ask(gw.base_url, "how can I reset my password", system="Be brief.").headers["x-triage-cache"] == "miss"
    assert ask(gw.base_url, "how can I reset my password", model="other").headers["x-triage-cache"] == "miss"
    assert engine_calls(gw) == 4


def test_two_gateways_on_one_redis_share_semantic_entries(
    redis_url: str, gateways: Callable[[str, int], list[str]], trained_heads: Path
) -> None:
    state = f'{{store: redis, url: "{redis_url}", prefix: "t-semantic"}}'
    first, second = gateways(semantic_policy(trained_heads, state), 2)
    assert ask(first, "How do I reset my password?").headers["x-triage-cache"] == "miss"
    deadline, result = time.monotonic() + 10, ""
    while time.monotonic() < deadline:  # the other gateway reads the fleet's entries every half second
        result = ask(second, "how can I reset my password").headers["x-triage-cache"]
        if result == "hit":
            break
        time.sleep(0.3)
    assert result == "hit"


def test_audited_wrong_hits_tighten_the_rule() -> None:
    import asyncio

    import numpy as np

    from gateway.service.cache.semantic import MIN_AUDITS, SemanticCache, bounds
    from gateway.state.stores import MemoryStore
    from policies.schema import SemanticCacheSpec

    async def embed(text: str) -> np.ndarray:
        return np.ones(4, dtype=np.float32) / 2

    spec = SemanticCacheSpec(models=["m"], rule={"kind": "global", "similarity": 0.9}, false_hit_budget=0.01)
    cache = SemanticCache(spec, embed, 4, "v", MemoryStore())
    for _ in range(MIN_AUDITS):
        cache.audited_hit(True)
    cache.audited_hit(False)
    assert cache.rule.similarity == 0.9  # 1 wrong in 31: over 1%, but not for sure
    cache.audited_hit(False)
    assert cache.rule.similarity == pytest.approx(0.91) and cache.audited == 0  # 2 in 32: for sure
    assert bounds(0, 0) == (0.0, 1.0) and bounds(0, 300)[1] < 0.01 < bounds(1, 100)[1]
    assert bounds(2, 32)[0] > 0.01 > bounds(1, 31)[0]
    # the index: an entry whose answer agrees with a kept one joins its group
    q = np.array([1, 0, 0, 0], dtype=np.float32)
    g1 = cache.add("ctx", q, np.array([0, 1, 0, 0], dtype=np.float32), "k1")
    g2 = cache.add("ctx", q, np.array([0, 0.99, 0.141, 0], dtype=np.float32), "k2")
    g3 = cache.add("ctx", q, np.array([0, 0, 1, 0], dtype=np.float32), "k3")
    assert g1 == g2 != g3
    found = cache.find("ctx", q)
    assert found is not None and found.key in ("k1", "k2", "k3") and cache.find("other", q) is None
    asyncio.run(cache.close())


def test_a_semantic_rule_that_does_not_read_is_a_policy_problem_with_its_place(tmp_path: Path) -> None:
    from policies import loader
    from policies.errors import PolicyInvalid

    text = policy(extra="response_cache:\n  semantic: {models: [scripted], rule: {kind: nearest}}\n")
    text = text.replace("version: 1\n", "version: 1\nclassifier: {heads: [question_type]}\n")
    with pytest.raises(PolicyInvalid) as caught:
        loader.parse(text, "p.yaml", tmp_path)
    assert "response_cache.semantic.rule" in str(caught.value) and "unknown semantic cache rule kind" in str(
        caught.value
    )
    assert loader.parse(text.replace("kind: nearest", "kind: vote, agree: 8"), "p.yaml", tmp_path)
