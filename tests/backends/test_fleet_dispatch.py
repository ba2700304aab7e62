"""Dispatch that sees the fleet, against real vLLM engines (its CPU build, SmolLM2-135M): an engine's
own counters change the choice, a dead replica is skipped at once, two gateways sharing a Redis
agree on a prefix, and a Batch API job yields to online load.

Which replica served is read from the engines' own counters (``vllm:request_success_total``), and
an engine is kept busy by long streams sent to it directly, past the gateway, as another gateway's
traffic would."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from policies.dispatch import block_hashes, rank
from tests.backends.test_vllm import FEW_SHOT
from tests.batch.test_batches import line, wait_batch
from tests.conftest import Gateway, VllmServer, free_port

# a prompt some of vLLM's 128-token blocks long, the same start for every question
TEMPLATE = "You are a terse assistant for the billing team. Answer in one word. " * 30 + "Question: "


def policy(*bases: str, pool: str, extra: str = "") -> str:
    replicas = "".join(f"      - api_base: {b}\n" for b in bases)
    return f"""version: 1
backends:
  pool:
    type: openai
    replicas:
{replicas}    retries: {{attempts: 2, backoff_s: 0.01}}
    health: {{enabled: false}}
    timeouts: {{first_byte_s: 120}}
{pool}models:
  smollm2: {{backend: pool}}
{extra}"""


@contextlib.contextmanager
def busy(server: VllmServer, streams: int) -> Iterator[None]:
    """``streams`` long generations running on ``server`` until the block ends (then dropped: vLLM
    aborts a request whose client left)."""
    stop = threading.Event()

    def one() -> None:
        body = {"model": "smollm2", "prompt": "Count:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", server.api_base + "/completions", json=body) as resp,
        ):
            for _ in resp.iter_bytes():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=one, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    try:
        until(lambda: server.metric("vllm:num_requests_running") >= streams, 60)
        time.sleep(0.5)  # the gateways' next polls
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        until(lambda: server.metric("vllm:num_requests_running") == 0, 60)
        time.sleep(0.5)


def until(ok: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def served(*servers: VllmServer) -> list[float]:
    return [s.metric("vllm:request_success_total") for s in servers]


def known(gw: Gateway, *servers: VllmServer) -> None:
    """Wait until ``gw`` reads every server's own counters (on a loaded machine a busy engine's
    /metrics can miss a read's deadline, and the rule then counts this gateway's requests only).
    The policies here also keep an engine's figures for 10 s (``stale_s``): by default they go
    stale after 1 s, and a busy CPU engine's read took longer than that in one run."""

    def all_known() -> bool:
        with gw.http() as http:
            text = http.get("/metrics").text
        return all(
            f'triage_replica_signals_known{{backend="pool",replica="{s.api_base}"}} 1.0' in text for s in servers
        )

    until(all_known, 60)


def ask(gw: Gateway, text: str) -> None:
    gw.client().chat.completions.create(model="smollm2", max_tokens=1, messages=[{"role": "user", "content": text}])


def test_an_engines_own_counters_change_the_choice(
    gateway: Callable[..., Gateway], vllm_server: VllmServer, vllm_replica: VllmServer
) -> None:
    pool = "    strategy: least_load\n    dispatch: {engine: vllm, interval_s: 0.1, timeout_s: 5, stale_s: 10}\n"
    gw = gateway(policy(vllm_server.api_base, vllm_replica.api_base, pool=pool))
    with busy(vllm_server, 3):  # another gateway's traffic: this one has nothing in flight there
        known(gw, vllm_server, vllm_replica)
        before = served(vllm_server, vllm_replica)
        for i in range(4):
            ask(gw, f"Say a colour, {i}.")
        after = served(vllm_server, vllm_replica)
    # without the engine's counters the two replicas tie at zero and would take two each
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 4]


def test_a_dead_replica_is_skipped_at_once(gateway: Callable[..., Gateway], vllm_server: VllmServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens
    pool = "    strategy: prefix\n    dispatch: {engine: vllm, interval_s: 0.1}\n"
    gw = gateway(policy(dead, vllm_server.api_base, pool=pool))
    time.sleep(0.5)  # a few polls; the health check is off: only the poller can tell it is dead
    for i in range(6):
        ask(gw, f"{TEMPLATE}{i}: a colour?")
    with gw.http() as http:
        text = http.get("/metrics").text
    tried = [ln for ln in text.splitlines() if ln.startswith("triage_upstream_attempts_total{") and dead in ln]
    assert tried == [], tried  # never tried: out before any request reached it
    assert 'triage_replica_signals_known{backend="pool",replica="' + dead + '"} 0.0' in text


def test_two_gateways_sharing_a_redis_agree_on_a_prefix(
    gateway: Callable[..., Gateway], vllm_server: VllmServer, vllm_replica: VllmServer, redis_url: str
) -> None:
    servers = (vllm_server, vllm_replica)
    dispatch = "{engine: vllm, interval_s: 0.1, timeout_s: 5, stale_s: 10, block_tokens: 128, slack: 2}"
    pool = f"    strategy: prefix\n    dispatch: {dispatch}\n"
    text = policy(*(s.api_base for s in servers), pool=pool, extra=f"state: {{store: redis, url: '{redis_url}'}}\n")
    one, two = gateway(text), gateway(text)
    first_block = block_hashes(TEMPLATE, 128 * 4)[0]
    ranked_first = max(range(2), key=lambda i: rank(first_block, i))  # where a tie would send the template
    hot, other = servers[ranked_first], servers[1 - ranked_first]
    with busy(hot, 4):  # gateway one sends the template elsewhere, to the replica the tie would not pick
        known(one, *servers)
        before = served(*servers)
        ask(one, TEMPLATE + "first question?")
    assert served(*servers)[1 - ranked_first] - before[1 - ranked_first] == 1
    time.sleep(0.5)  # the loads are even again; gateway two learns where the template went
    before = served(*servers)
    for i in range(3):
        ask(two, f"{TEMPLATE}question {i} from gateway two?")
        ask(one, f"{TEMPLATE}question {i} from gateway one?")
    after = served(*servers)
    assert after[1 - ranked_first] - before[1 - ranked_first] == 6, (before, after)  # without sharing: a tie, to hot
    assert other.metric("vllm:prefix_cache_hits_total") > 0


def test_a_batch_yields_to_online_load(
    gateway: Callable[..., Gateway], vllm_server: VllmServer, tmp_path: Path
) -> None:
    dispatch = "{engine: vllm, interval_s: 0.1, timeout_s: 5, stale_s: 10, batch_max_load: 1}"
    pool = f"    strategy: least_load\n    dispatch: {dispatch}\n"
    gw = gateway(policy(vllm_server.api_base, pool=pool, extra=f'batches: {{dir: "{tmp_path}", concurrency: 4}}\n'))
    client = gw.client()
    lines = [line(f"r{i}", f"{FEW_SHOT}colour of snow {i}? A:") for i in range(4)]
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    with busy(vllm_server, 2):
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        t0 = time.monotonic()
        ask(gw, "Say a colour.")  # online goes first, into the busy engine
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
        held = client.batches.retrieve(batch.id)
        assert held.request_counts is None or held.request_counts.completed == 0, held.request_counts
    done = wait_batch(client, batch.id, timeout=300)  # the burst is over: the batch runs
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 4
