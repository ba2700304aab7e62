"""What the gateway reads of each engine (backends/engine_load.py, engine_poll.py), how the replica
set counts it (backends/replicas.py), and the prefix index shared between gateways
(backends/index_feed.py). Fakes for the engines' answers; the real engines are in test_fleet_dispatch.py."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from structlog.testing import capture_logs

from backends.engine_load import EngineLoad, Malformed, parse
from backends.engine_poll import EnginePoller
from backends.index_feed import IndexFeed
from backends.replicas import Dispatch, ReplicaSet, ReplicaState

VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 1024.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 512.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",enable_prefix_caching="True",num_gpu_blocks="455"} 1.0
"""


def test_each_engines_figures_are_read() -> None:
    v = parse("vllm", "text/plain; version=0.0.4", VLLM)
    assert (v.running, v.waiting, v.kv_usage, v.block_size, v.blocks) == (3, 2, 0.25, 128, 455)
    assert (v.prefix_queries, v.prefix_hits) == (1024, 512)
    llama = b"llamacpp:requests_processing 1\nllamacpp:requests_deferred 4\nllamacpp:kv_cache_usage_ratio 0.5\n"
    assert parse("llamacpp", "text/plain", llama) == EngineLoad(1, 4, 0.5)
    sglang = b'[{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 900}, {"num_reqs": 1}]'
    assert parse("sglang", "application/json", sglang) == EngineLoad(4, 2)


@pytest.mark.parametrize(
    "kind,body",
    [
        ("vllm", b"<html>not metrics</html>"),
        ("vllm", b"some_other_metric 1\n"),  # an engine's endpoint, not this engine's figures
        ("vllm", b"\xff\xfe"),
        ("sglang", b"{not json"),
        ("sglang", b'{"load": 3}'),
    ],
)
def test_an_answer_without_load_is_malformed_never_idle(kind: str, body: bytes) -> None:
    with pytest.raises(Malformed):
        parse(kind, "application/json" if body.startswith(b"{") else "text/plain", body)  # type: ignore[arg-type]


def _set(n: int = 2, strategy: str = "least_load") -> tuple[ReplicaSet, list[float]]:
    now = [100.0]
    rs = ReplicaSet(
        [ReplicaState(f"http://r{i}/v1", None) for i in range(n)],
        strategy,
        1.0,
        clock=lambda: now[0],
        dispatch=Dispatch(signals_ttl_s=1.0),
    )
    return rs, now


def test_the_engines_counters_change_the_choice_until_they_go_stale() -> None:
    rs, now = _set()
    a, b = rs.replicas
    rs.observe(a, EngineLoad(running=6, waiting=3))  # another gateway's requests
    assert rs.pick(set()) is b
    b.outstanding = 2  # this gateway's own, sent since the engine last said
    assert rs.load(b, now[0]) == 2 and rs.pick(set()) is b
    now[0] += 2.0  # the figures are stale: unknown, counted as this gateway's own requests only
    assert rs.load(a, now[0]) == 0 and rs.pick(set()) is a
    rs.observe(a, None)  # a read that failed: unknown at once
    assert not rs.known(a)


def test_own_requests_sent_after_the_poll_count_on_top_of_the_engines() -> None:
    rs, now = _set()
    a, _ = rs.replicas
    a.outstanding = 2
    rs.observe(a, EngineLoad(running=5, waiting=0))  # its 5 include this gateway's 2
    a.outstanding = 4
    assert rs.load(a, now[0]) == 7
    a.outstanding = 0  # this gateway's ended: the engine's other 3 stay
    assert rs.load(a, now[0]) == 3


def test_a_batch_line_waits_while_every_replica_has_a_queue() -> None:
    rs, _ = _set()
    for r in rs.replicas:
        rs.observe(r, EngineLoad(running=1, waiting=1))
    assert rs.pick(set(), background=True) is None
    assert rs.pick(set()) is not None  # an online request is never held
    rs.observe(rs.replicas[1], EngineLoad(running=1, waiting=0))
    assert rs.pick(set(), background=True) is rs.replicas[1]


def test_a_slow_absent_or_malformed_endpoint_is_unknown_logged_and_counted() -> None:
    asyncio.run(_slow_absent_malformed())


async def _slow_absent_malformed() -> None:
    rs, _ = _set(3)
    answers = {
        "http://r0/v1": (200, "text/plain", VLLM),
        "http://r1/v1": (200, "text/plain", b"<html>"),
        "http://r2/v1": None,  # slow
    }

    async def fetch(replica: ReplicaState, path: str) -> tuple[int, str, bytes]:
        assert path == "/metrics"
        got = answers[replica.api_base]
        if got is None:
            await asyncio.sleep(1)
            raise AssertionError("not reached")
        return got

    poller = EnginePoller("pool", rs, fetch, "vllm", "/metrics", 0.05, 0.05)
    with capture_logs() as logs:
        await poller.poll()
        await poller.poll()
    r0, r1, r2 = rs.replicas
    assert rs.known(r0) and not rs.known(r1) and not rs.known(r2)
    assert poller.failed == {"http://r0/v1": 0, "http://r1/v1": 2, "http://r2/v1": 2}
    unknown = [e for e in logs if e["event"] == "engine_signals_unknown"]
    assert sorted(e["replica"] for e in unknown) == ["http://r1/v1", "http://r2/v1"]  # once each, not per read
    assert "malformed" in unknown[0]["reason"] or "malformed" in unknown[1]["reason"]
    answers["http://r1/v1"] = (200, "text/plain", VLLM)
    with capture_logs() as logs:
        await poller.poll()
    assert rs.known(r1) and [e["event"] for e in logs] == ["engine_signals_known"]


class _Feed:
    """The store's feed as the memory of one process shares it (a Redis stream in a fleet)."""

    def __init__(self) -> None:
        self.items: dict[str, list[bytes]] = defaultdict(list)

    async def feed_add(self, name: str, item: bytes, most: int = 100_000) -> None:
        self.items[name].append(item)

    async def feed_read(self, name: str, after: str, most: int = 1000) -> tuple[str, list[bytes]]:
        start = int(after)
        got = self.items[name][start : start + most]
        return str(start + len(got)), got


def test_two_gateways_share_what_they_sent_and_then_agree() -> None:
    asyncio.run(_two_gateways())


async def _two_gateways() -> None:
    feed = _Feed()
    gw = [_set(4, "prefix")[0] for _ in range(2)]
    feeds = [IndexFeed("pool", rs, feed, flush_s=0.02, read_s=0.02) for rs in gw]
    for f in feeds:
        await f.start()
    try:
        prompt = "A long shared instruction for every ticket. " * 30
        first = gw[0].pick(set(), text=prompt + "ticket 1")
        assert first is not None
        first.outstanding += 1  # busy at gateway 0 only: gateway 1 must still follow the cache
        await asyncio.sleep(0.2)
        second = gw[1].pick(set(), text=prompt + "ticket 2")
        assert second is not None and second.api_base == first.api_base
        assert feeds[1].applied >= 1 and feeds[0].applied == 0  # its own items are not taken twice
        feed.items["dispatch:pool"].append(b"{not json")
        await asyncio.sleep(0.1)  # a malformed item is skipped, the feed goes on
        assert all(not t.done() for f in feeds for t in f._tasks)
    finally:
        for f in feeds:
            await f.close()


def test_a_refused_connection_takes_the_replica_out_at_once_and_a_good_read_brings_it_back() -> None:
    from backends.http1 import Refused

    rs, _ = _set(2)
    dead = {"http://r1/v1"}

    async def fetch(replica: ReplicaState, path: str) -> tuple[int, str, bytes]:
        if replica.api_base in dead:
            raise Refused("cannot connect")
        return 200, "text/plain", VLLM

    poller = EnginePoller("pool", rs, fetch, "vllm", "/metrics", 0.05, 0.5)
    asyncio.run(poller.poll())
    assert [rs.pick(set()) for _ in range(4)] == [rs.replicas[0]] * 4  # skipped before any request fails there
    dead.clear()
    asyncio.run(poller.poll())
    assert rs.replicas[1].active_ok


def test_least_load_ties_without_a_key_go_round() -> None:
    rs, _ = _set(3)
    assert {rs.pick(set()).api_base for _ in range(30)} == {r.api_base for r in rs.replicas}  # type: ignore[union-attr]


def test_a_conversations_next_turn_goes_where_its_answer_is_cached() -> None:
    rs, _ = _set(4, "prefix")
    turn1 = "User: plan a trip to Lisbon for a family of four, with a day for museums. " * 6
    first = rs.pick(set(), text=turn1)
    assert first is not None
    answer = "Day one: the Alfama and the castle; day two: the tile museum and Belem. " * 8
    rs.extend(first, turn1 + "\n" + answer)  # what the backend does when the answer is done
    first.outstanding += 1  # still busy with another request: within the bound
    turn2 = turn1 + "\n" + answer + "\nUser: and if it rains?"
    assert rs.pick(set(), text=turn2) is first
