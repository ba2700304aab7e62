"""Stored Responses in the fleet's Redis (gateway/state/responses_redis.py): a conversation made
on one gateway continues on another that shares the store, with the same ownership and bounds as
one process's store. Two real gateways (uvicorn), a real Redis, a scripted backend."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import openai
import pytest

from gateway.state.responses_redis import RedisResponses
from gateway.state.stores import RedisStore
from policies.errors import NotFound
from tests.conftest import Gateway
from tests.http.test_hardening import keys, policy


def shared(redis_url: str, prefix: str) -> str:
    return f"state: {{store: redis, url: '{redis_url}', prefix: {prefix}}}\n" + keys("sk-alice", "sk-bob")


def test_a_conversation_continues_on_another_gateway_and_stays_its_keys(
    gateway: Callable[..., Gateway], redis_url: str
) -> None:
    text = policy(extra=shared(redis_url, "t-resp"))
    one, two = gateway(text), gateway(text)
    first = one.client("sk-alice").responses.create(model="scripted", input="My name is Ada.")
    assert two.client("sk-alice").responses.retrieve(first.id).id == first.id
    second = two.client("sk-alice").responses.create(
        model="scripted", input="What is my name?", previous_response_id=first.id
    )
    with one.client("sk-alice").responses.stream(
        model="scripted", input="And again?", previous_response_id=second.id
    ) as stream:
        third = stream.get_final_response()
    assert one.client("sk-alice").responses.retrieve(third.id).id == third.id  # stored before its last event
    for gw in (one, two):  # another key: the 404 of a missing id, on either gateway
        with pytest.raises(openai.NotFoundError):
            gw.client("sk-bob").responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            gw.client("sk-bob").responses.create(model="scripted", input="x", previous_response_id=first.id)
    two.client("sk-alice").responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        one.client("sk-alice").responses.retrieve(first.id)
    assert one.client("sk-alice").responses.retrieve(second.id).id == second.id  # the rest of the chain stays


def test_a_keys_responses_are_bounded_by_bytes_in_the_fleets_store(redis_url: str) -> None:
    async def main() -> None:
        store = RedisStore(redis_url, "t-resp-bound", 2.0)
        try:
            kept = RedisResponses(store, ttl_s=60, max_bytes_per_owner=4_000)
            turn = [{"role": "user", "content": "x" * 900}]
            for i in range(6):  # about 950 bytes each: the key's newest 4 fit
                await kept.put({"id": f"a{i}"}, turn, owner="alice")
            await kept.put({"id": "b0"}, turn, owner="bob")
            found = []
            for i in range(6):
                try:
                    await kept.get(f"a{i}", "alice")
                    found.append(i)
                except NotFound:
                    pass
            assert found == [2, 3, 4, 5], found  # the oldest went first
            assert (await kept.get("b0", "bob")).owner == "bob"  # another key's bound is its own
            assert (await kept.get("a5", None, operator=True)).owner == "alice"
        finally:
            await store.close()

    asyncio.run(main())
