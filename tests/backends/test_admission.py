"""Online prefix admission: the pure choice, the waiting room's slots and timeouts, and two real
llama.cpp replicas behind the gateway each serving one template back to back."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import structlog

from backends.admission import Admission, View, Waiting, choose
from backends.prefix import approx_tokens, sort_key
from backends.replicas import ReplicaSet, ReplicaState
from policies.errors import PolicyInvalid, UpstreamTimeout
from policies.loader import parse
from tests.conftest import Gateway, LlamaServer
from tests.http.test_openai_surface import pool_policy

A = "You are a careful assistant. Read the question, think about the facts, and answer with a single word only. "
B = "Translate the sentence into French, keeping the names unchanged and the punctuation as it is in the original. "


def key(text: str) -> bytes:
    return sort_key(approx_tokens(text))


RULES = {"max_skips": 2, "window_s": 2.0, "min_shared": 8}


def test_a_freed_replica_takes_the_request_its_cache_holds() -> None:
    waiting = [Waiting(key(B + "one"), 0.0), Waiting(key(A + "two"), 0.1)]
    replicas = [View(1, (key(A + "zero"),)), View(0, (key(B + "zero"),))]
    # the A request is younger, but replica 0 holds A: it goes first; B waits for busy replica 1
    assert choose(waiting, replicas, 0.2, **RULES) == [(1, 0)]


def test_a_request_passed_over_max_skips_times_goes_first() -> None:
    waiting = [Waiting(key(B + "one"), 0.0, skipped=2), Waiting(key(A + "two"), 0.1)]
    replicas = [View(1, (key(A + "zero"),)), View(0, (key(B + "zero"),))]
    assert choose(waiting, replicas, 0.2, **RULES) == [(0, 0)]
    # first come, first served with max_skips 0
    fresh = [Waiting(key(B + "one"), 0.0), Waiting(key(A + "two"), 0.1)]
    assert choose(fresh, replicas, 0.2, **{**RULES, "max_skips": 0}) == [(0, 0)]


def test_skips_count_within_one_choice() -> None:
    waiting = [Waiting(key(B + "old"), 0.0, skipped=1)] + [Waiting(key(A + str(i)), 0.1) for i in range(3)]
    replicas = [View(3, (key(A + "zero"),)), View(0, (key(B + "zero"),))]
    # one A request overtakes the B request (its second skip), then B goes before the other As
    assert choose(waiting, replicas, 0.2, **RULES)[:2] == [(1, 0), (0, 0)]


def test_a_held_request_waits_for_its_replica_only_within_the_window() -> None:
    waiting = [Waiting(key(B + "one"), 0.0)]
    replicas = [View(1, (key(A + "zero"),)), View(0, (key(B + "zero"),))]
    assert choose(waiting, replicas, 1.0, **RULES) == []  # replica 1 holds B and is busy: wait
    assert choose(waiting, replicas, 2.5, **RULES) == [(0, 0)]  # its window is over: the free one
    assert choose(waiting, replicas, 0.0, **{**RULES, "window_s": 0.0}) == [(0, 0)]


def test_a_request_no_replica_holds_goes_to_the_least_wanted_free_replica() -> None:
    waiting = [Waiting(key("something else entirely"), 0.0), Waiting(key(A + "x"), 0.0)]
    replicas = [View(1, (key(A + "zero"),)), View(1, ())]
    # A goes to replica 0 (warm); the cold one to replica 1, which no waiting request wants
    assert sorted(choose(waiting, replicas, 0.0, **RULES)) == [(0, 1), (1, 0)]


def test_choice_respects_free_slots_and_gives_each_request_once() -> None:
    waiting = [Waiting(key(A + str(i)), i / 10) for i in range(5)]
    replicas = [View(2, (key(A),)), View(1, (key(B),)), View(3, (key(A),), up=False)]
    picks = choose(waiting, replicas, 10.0, **RULES)
    assert len(picks) == 3 and len({w for w, _ in picks}) == 3
    assert sorted(r for _, r in picks) == [0, 0, 1]  # the replica that is down gets none


def _room(slots: int = 1, replicas: int = 1, window_ms: float = 2000) -> Admission:
    states = [ReplicaState(f"http://r{i}/v1", None) for i in range(replicas)]
    return Admission(
        ReplicaSet(states, "round_robin", 1.0),
        slots=slots,
        max_skips=8,
        window_ms=window_ms,
        cached_prompts=slots,
        min_shared_tokens=8,
    )


def test_the_waiting_room_queues_past_the_slots_and_times_out() -> None:
    async def main() -> None:
        room = _room()
        first = await room.acquire(A + "one", 1.0)
        waiter = asyncio.create_task(room.acquire(A + "two", 5.0))
        await asyncio.sleep(0.01)
        assert room.waiting == 1 and not waiter.done()
        with pytest.raises(UpstreamTimeout, match="no replica slot"):
            await room.acquire(B + "three", 0.05)
        assert room.waiting == 1  # the timed-out request left the queue
        first.release()
        first.release()  # idempotent
        second = await asyncio.wait_for(waiter, 1.0)
        assert second.replica is first.replica and room.replicas[0].in_flight == 1
        second.release()
        assert room.replicas[0].in_flight == 0

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_no_slot_behind() -> None:
    async def main() -> None:
        room = _room()
        first = await room.acquire(A, 1.0)
        waiter = asyncio.create_task(room.acquire(A + "two", 5.0))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        first.release()
        assert room.waiting == 0 and room.replicas[0].in_flight == 0

    asyncio.run(main())


def test_a_held_request_goes_cold_when_its_window_ends() -> None:
    async def main() -> None:
        room = _room(replicas=2, window_ms=50)
        first = await room.acquire(A + "one", 1.0)  # replica X holds A and is busy
        held = asyncio.create_task(room.acquire(A + "two", 5.0))  # waits for X ...
        await asyncio.sleep(0.01)
        assert not held.done()
        second = await asyncio.wait_for(held, 1.0)  # ... until its window ends: the other replica
        assert second.replica is not first.replica
        first.release()
        second.release()

    asyncio.run(main())


def test_admission_and_prefix_affinity_are_one_or_the_other() -> None:
    text = pool_policy("http://127.0.0.1:9/v1").replace(
        "    retries:", "    prefix_affinity_chars: 40\n    admission: {slots: 1}\n    retries:"
    )
    with pytest.raises(PolicyInvalid, match="set one"):
        parse(text)


def test_two_replicas_each_serve_one_template_back_to_back(
    gateway: Callable[..., Gateway], llama_server: LlamaServer, spare_llama_server: LlamaServer
) -> None:
    admission = "    admission: {window_ms: 60000, max_skips: 100, min_shared_tokens: 8}\n    retries:"
    # health probes off: one that times out on a busy one-slot server takes it out, and its work moves
    policy = (
        pool_policy(llama_server.api_base, spare_llama_server.api_base)
        .replace("    retries:", admission)
        .replace("interval_s: 0.5", "enabled: false")
    )
    gw = gateway(policy)
    client = gw.client()
    prompts = {f"req-{i}": (A if i % 2 else B) + f"Item {i}." for i in range(8)}
    errors: list[BaseException] = []

    def send(rid: str, prompt: str) -> None:
        try:
            client.chat.completions.create(
                model="smollm2",
                max_tokens=1,
                extra_headers={"x-request-id": rid},
                messages=[{"role": "user", "content": prompt}],
            )
        except BaseException as exc:
            errors.append(exc)

    with structlog.testing.capture_logs() as logs:
        threads = [threading.Thread(target=send, args=item) for item in prompts.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    replica_of = {e["request_id"]: e["replica"] for e in logs if e.get("event") == "request"}
    assert set(replica_of) == set(prompts)
    by_template: dict[str, set[str]] = {}
    for rid, prompt in prompts.items():
        by_template.setdefault(prompt[:20], set()).add(replica_of[rid])
    # each template on one replica, and the two templates on different replicas
    assert all(len(r) == 1 for r in by_template.values())
    assert len(set.union(*by_template.values())) == 2


def test_streams_and_failures_give_their_slot_back(gateway: Callable[..., Gateway], llama_server: LlamaServer) -> None:
    """One replica, one slot: a leaked slot would make the next request wait out total_s (a 504)."""
    dead = "http://127.0.0.1:9/v1"  # nothing listens: the first try fails, the retry goes to the live one
    policy = (
        pool_policy(dead, llama_server.api_base)
        .replace("    retries:", "    admission: {slots: 1}\n    retries:")
        .replace("first_byte_s: 60", "first_byte_s: 60, total_s: 20")
        .replace("interval_s: 0.5", "enabled: false")
    )
    gw = gateway(policy)
    client = gw.client()
    msg = [{"role": "user", "content": "Say yes."}]
    for _ in range(3):
        chunks = list(client.chat.completions.create(model="smollm2", max_tokens=2, messages=msg, stream=True))
        assert chunks
        assert client.chat.completions.create(model="smollm2", max_tokens=2, messages=msg).choices
    with gw.http() as http:  # every slot handed back, nothing waiting
        metrics = http.get("/metrics").text
    assert 'triage_admission_waiting{backend="pool"} 0.0' in metrics
    assert f'triage_admission_in_flight{{backend="pool",replica="{llama_server.api_base}"}} 0.0' in metrics
    assert f'triage_admission_in_flight{{backend="pool",replica="{dead}"}} 0.0' in metrics


def test_no_timer_spins_when_only_a_replica_that_is_down_has_room() -> None:
    async def main() -> None:
        room = _room(replicas=2, window_ms=0)
        room.replicas[1].state.ejected_until = room.clock() + 60  # down
        first = await room.acquire(A + "one", 1.0)
        waiter = asyncio.create_task(room.acquire(A + "two", 5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done() and room._timer is None  # a release wakes it, not a timer due now
        first.release()
        second = await asyncio.wait_for(waiter, 1.0)
        assert second.replica is first.replica
        second.release()

    asyncio.run(main())


def test_a_client_that_gives_up_while_waiting_never_reaches_the_engine(gateway: Callable[..., Gateway]) -> None:
    """The one slot is held by a request to a replica that accepts connections and never answers
    (a listening socket nobody serves: a hung engine, which a real one cannot be made to be on
    demand). A second request queues behind it and its client gives up: it must leave the queue."""
    import socket

    import httpx

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    base = f"http://127.0.0.1:{hole.getsockname()[1]}/v1"
    gw = gateway(
        pool_policy(base)
        .replace("    retries:", "    admission: {slots: 1}\n    retries:")
        .replace("interval_s: 0.5", "enabled: false")
    )
    body = {"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi."}]}
    with structlog.testing.capture_logs() as logs, gw.http() as http:
        holder = threading.Thread(
            target=lambda: http.post("/v1/chat/completions", json=body, headers={"x-request-id": "held"})
        )
        holder.start()
        slot = f'triage_admission_in_flight{{backend="pool",replica="{base}"}} 1.0'
        for _ in range(200):
            if slot in http.get("/metrics").text:
                break
            threading.Event().wait(0.05)
        with httpx.Client(base_url=gw.base_url) as other, pytest.raises(httpx.ReadTimeout):
            other.post("/v1/chat/completions", json=body, headers={"x-request-id": "gone"}, timeout=0.3)
        for _ in range(100):  # the gateway notices within a quarter of a second or so
            if 'triage_admission_waiting{backend="pool"} 0.0' in http.get("/metrics").text:
                break
            threading.Event().wait(0.05)
        hole.close()  # the hung engine goes away: the held request fails, the slot frees
        holder.join()
        metrics = http.get("/metrics").text
    events = {e["request_id"]: e for e in logs if e.get("event") == "request"}
    assert events["gone"]["status"] == 499 and events["gone"]["attempts"] == []  # never reached the engine
    assert events["held"]["status"] == 502
    assert 'triage_admission_waiting{backend="pool"} 0.0' in metrics
    assert f'triage_admission_in_flight{{backend="pool",replica="{base}"}} 0.0' in metrics
