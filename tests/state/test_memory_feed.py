"""The cascade's memory shared through Redis (``gateway/state/memory_redis.py``, issue 56), on a real
server: one gateway's remembered answer reaches another's ring, a new gateway starts with what the
stream holds, its own entries and foreign ones are not added twice, another encoder depth keeps
its own stream, a closed feed takes nothing more, and a Redis that is gone costs counts and a log
line, never an exception."""

from __future__ import annotations

import asyncio

import numpy as np

from gateway.state.memory_redis import MemoryFeed, decode, encode
from gateway.state.stores import RedisStore
from policies.cascade import Question
from policies.memory import Memory
from tests.servers import free_port

PLANET = Question("choice", "Which planet is the largest?", ("Mars", "Jupiter"))
BIGGEST = Question("choice", "Which planet is the biggest one?", ("Mars", "Jupiter"))
PIN = Question("yes_no", "Can I reset my PIN online?", ("yes", "no"), context="Bank FAQ", task=None)


def unit(seed: int, dim: int = 8) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=dim).astype(np.float32)
    return v / np.linalg.norm(v)


def test_an_entry_round_trips() -> None:
    scored = Question("score", "How good is it?", ("1", "2", "3"), scale=(1, 3))
    for q in (PLANET, PIN, scored):
        v, back, answer, origin = decode({k.encode(): x for k, x in encode(unit(1), q, "x", "me").items()})
        assert back == q and answer == "x" and origin == "me" and np.allclose(v, unit(1))


async def _feeds(url: str, prefix: str, layers: int = 6) -> tuple[RedisStore, MemoryFeed, MemoryFeed]:
    store = RedisStore(url, prefix, timeout_s=2.0)
    a = MemoryFeed(store, Memory(100), layers, flush_s=0.01)
    return store, a, MemoryFeed(store, Memory(100), layers, sync_s=60.0)


def test_one_gateways_answer_reaches_the_others_ring(redis_url: str) -> None:
    async def main() -> None:
        store, a, b = await _feeds(redis_url, "feed-1")
        a.memory.add(unit(1), PLANET, "Jupiter")
        a.push(unit(1), PLANET, "Jupiter")
        await a.close()  # written
        assert a.written == 1 and await a.sync() == 0  # its own entry: not added again
        assert await b.sync() == 1 and b.read == 1
        [got] = b.memory.nearest(unit(1), BIGGEST, 3, 0.5)
        assert got.question == PLANET and got.answer == "Jupiter"
        assert await b.sync() == 0  # after the last entry read: nothing new

        newcomer = MemoryFeed(store, Memory(100), 6)
        assert await newcomer.sync() == 1 and len(newcomer.memory) == 1  # starts with the stream

        deeper = MemoryFeed(store, Memory(100), 3)  # embeddings of three layers: another stream
        assert await deeper.sync() == 0

        narrow = MemoryFeed(store, Memory(100), 6)
        narrow.memory.add(unit(2, dim=4), PIN, "yes")  # a ring of 4-value embeddings: the 8-value entry does not fit
        await store.redis.xadd(narrow.key, {"q": b"not json", "v": b"\x00" * 8})
        assert await narrow.sync() == 0 and narrow.skipped == 2 and len(narrow.memory) == 1
        await store.close()

    asyncio.run(main())


def test_a_gateway_asking_for_the_fleets_answers_never_waits(redis_url: str) -> None:
    async def main() -> None:
        store, a, b = await _feeds(redis_url, "feed-2")
        a.push(unit(3), PIN, "yes")
        await a.close()
        b.freshen()  # starts a read in the background
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(b.memory):
                break
        assert len(b.memory) == 1
        b.freshen()  # within sync_s of the last read: none started
        assert b._sync_task is None
        a.push(unit(4), PLANET, "Jupiter")  # after close (a retired runtime's feed): dropped, never written
        assert a.dropped == 1 and a.written == 1
        await store.close()

    asyncio.run(main())


def test_redis_gone_costs_counts_not_answers() -> None:
    async def main() -> None:
        store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", "gone", timeout_s=0.5)
        feed = MemoryFeed(store, Memory(10), 6, flush_s=0.01)
        feed.push(unit(4), PLANET, "Jupiter")
        feed.push(unit(5), BIGGEST, "Jupiter")
        await feed.close()
        assert feed.failed == 2 and feed.written == 0
        assert await feed.sync() == 0 and feed.sync_failed == 1
        await store.close()

    asyncio.run(main())
