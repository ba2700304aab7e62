"""Hardening, round two: stored Responses belong to the key that made them, are bounded by bytes,
and a chained conversation counts against the body limit (a real gateway, a scripted backend)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.conftest import Gateway
from tests.http.test_hardening import keys, policy, still_serving


def test_a_key_cannot_read_delete_or_continue_another_keys_stored_response(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy(extra=keys("sk-alice", "sk-bob")))
    alice, bob = gw.client("sk-alice"), gw.client("sk-bob")
    mine = alice.responses.create(model="scripted", input="my secret plan")
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model="scripted", input="and then?", previous_response_id=mine.id)
    # the owner still reads, continues and deletes it
    assert alice.responses.retrieve(mine.id).id == mine.id
    assert alice.responses.create(model="scripted", input="and then?", previous_response_id=mine.id).output_text
    alice.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(mine.id)


def test_the_responses_store_is_bounded_by_bytes_in_all_and_per_key() -> None:
    asyncio.run(_bounded())


async def _bounded() -> None:
    from gateway.state.responses import ResponseStore

    store = ResponseStore(max_bytes=10_000, max_bytes_per_owner=4_000)
    turn = [{"role": "user", "content": "x" * 900}]
    for i in range(6):  # about 1 KB each: the key's bound keeps its newest 3
        await store.put({"id": f"a{i}"}, turn, owner="alice")
    kept = [i for i in range(6) if await _stored(store, f"a{i}", "alice")]
    assert kept == [2, 3, 4, 5] or kept == [3, 4, 5], kept
    assert store.bytes <= 4_000
    for i in range(12):
        await store.put({"id": f"k{i}"}, turn, owner=f"key{i}")
    assert store.bytes <= 10_000
    assert not await _stored(store, "a5", "alice")  # the oldest went first, across keys
    assert await _stored(store, "k11", "key11")


async def _stored(store: Any, rid: str, owner: str) -> bool:
    from policies.errors import NotFound

    try:
        await store.get(rid, owner)
    except NotFound:
        return False
    return True


def test_a_chained_conversation_counts_against_the_body_limit(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(policy().replace("version: 1\n", "version: 1\nlimits: {max_body_bytes: 4096}\n", 1))
    client = gw.client()
    previous = None
    with pytest.raises(openai.BadRequestError) as info:
        for _ in range(20):  # each turn about 1 KB: the chain passes 4 KB within a few
            previous = client.responses.create(
                model="scripted", input="y" * 1000, **({"previous_response_id": previous.id} if previous else {})
            )
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert previous is not None
    still_serving(gw)
