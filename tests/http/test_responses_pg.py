"""Stored Responses in the fleet's PostgreSQL (gateway/state/responses_pg.py, issue 54 item 6): a
conversation made on one gateway continues on another that shares the database, with the same
ownership and bounds as one process's store; PostgreSQL wins where Redis is set too; a database
that stops answering is a 503 in the API's shape, and the next request once it is back works.
Real gateways (uvicorn), a real PostgreSQL and Redis, a scripted backend, the official client."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
import httpx
import openai
import pytest
import redis

from gateway.state.responses_pg import PgResponses
from policies.errors import NotFound
from tests.conftest import Gateway
from tests.http.test_errors import MSG
from tests.http.test_hardening import keys, policy
from tests.servers import PgServer


def on_database(dsn: str, redis_url: str | None = None) -> str:
    also = f", store: redis, url: '{redis_url}', prefix: t-resp-pg" if redis_url else ""
    return f"state: {{database: '{dsn}'{also}}}\n" + keys("sk-alice", "sk-bob")


def rows(dsn: str, query: str) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetch(query)
        finally:
            await conn.close()

    return asyncio.run(run())


def test_a_conversation_continues_on_another_gateway_sharing_postgresql(
    gateway: Callable[..., Gateway], database: str
) -> None:
    text = policy(extra=on_database(database))
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
    assert two.client("sk-alice").responses.retrieve(third.id).id == third.id  # stored before its last event
    for gw in (one, two):  # another key: the 404 of a missing id, on either gateway
        with pytest.raises(openai.NotFoundError):
            gw.client("sk-bob").responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            gw.client("sk-bob").responses.create(model="scripted", input="x", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            gw.client("sk-bob").responses.delete(first.id)
    two.client("sk-alice").responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        one.client("sk-alice").responses.retrieve(first.id)
    assert one.client("sk-alice").responses.retrieve(second.id).id == second.id  # the rest of the chain stays
    kept = rows(database, "SELECT owner, count(*) AS n, sum(size) AS bytes FROM stored_responses GROUP BY owner")
    counted = rows(database, "SELECT owner, bytes FROM stored_response_owners WHERE bytes > 0")
    assert [(r["owner"], r["n"]) for r in kept] == [(kept[0]["owner"], 2)]  # alice's second and third
    assert {r["owner"]: r["bytes"] for r in counted} == {r["owner"]: r["bytes"] for r in kept}


def test_postgresql_wins_where_redis_is_set_too(gateway: Callable[..., Gateway], database: str, redis_url: str) -> None:
    gw = gateway(policy(extra=on_database(database, redis_url)))
    made = gw.client("sk-alice").responses.create(model="scripted", input="hi")
    assert [r["id"] for r in rows(database, "SELECT id FROM stored_responses")] == [made.id]
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.exists(f"t-resp-pg:resp:{made.id}") == 0
    finally:
        client.close()


def test_a_keys_responses_are_bounded_by_bytes_per_key_and_in_all(database: str) -> None:
    turn = [{"role": "user", "content": "x" * 900}]  # about 950 bytes a response

    async def main() -> None:
        kept = await PgResponses.open(database, ttl_s=60, max_bytes=6_000, max_bytes_per_owner=4_000)
        try:
            for i in range(6):  # the key's newest 4 fit
                await kept.put({"id": f"a{i}"}, turn, owner="alice")
            assert await found(kept, "a", 6, "alice") == [2, 3, 4, 5]  # the oldest went first
            for i in range(3):  # 4 + 3 responses are over 6,000 bytes in all: alice's oldest go
                await kept.put({"id": f"b{i}"}, turn, owner="bob")
            assert await found(kept, "b", 3, "bob") == [0, 1, 2]
            assert await found(kept, "a", 6, "alice") == [3, 4, 5]
            assert (await kept.get("a5", None, operator=True)).owner == "alice"  # an operator reads any
            with pytest.raises(NotFound):
                await kept.get("a5", "bob")
            # two gateways storing for one key at once: its bound holds, its count stays exact
            one, two = [await PgResponses.open(database, max_bytes=10**6, max_bytes_per_owner=4_000) for _ in "12"]
            try:
                await asyncio.gather(*(s.put({"id": f"c{i}"}, turn, "carol") for i, s in enumerate([one, two] * 10)))
            finally:
                await one.close()
                await two.close()
            assert len(await found(kept, "c", 20, "carol")) == 4
            short = await PgResponses.open(database, ttl_s=0.3)
            try:
                await short.put({"id": "d0"}, turn, owner="dave")
                await asyncio.sleep(0.5)
                with pytest.raises(NotFound):
                    await short.get("d0", "dave")
                await short.put({"id": "d1"}, turn, owner="dave")  # sweeps the key's expired
            finally:
                await short.close()
        finally:
            await kept.close()

    asyncio.run(main())
    kept = rows(database, "SELECT owner, count(*) AS n, sum(size) AS bytes FROM stored_responses GROUP BY owner")
    counted = rows(database, "SELECT owner, bytes FROM stored_response_owners WHERE bytes > 0")
    assert {r["owner"]: r["n"] for r in kept} == {"alice": 3, "bob": 3, "carol": 4, "dave": 1}
    assert {r["owner"]: r["bytes"] for r in counted} == {r["owner"]: r["bytes"] for r in kept}


async def found(store: PgResponses, prefix: str, n: int, owner: str) -> list[int]:
    out = []
    for i in range(n):
        try:
            await store.get(f"{prefix}{i}", owner)
            out.append(i)
        except NotFound:
            pass
    return out


def test_a_database_that_stops_answering_is_a_503_and_the_next_request_once_back_works(
    pg: PgServer, database: str, gateway: Callable[..., Gateway]
) -> None:
    gw = gateway(policy(extra=on_database(database)))
    alice = gw.client("sk-alice")
    first = alice.responses.create(model="scripted", input="My name is Ada.")
    name = database.rsplit("/", 1)[1]
    pg.sql(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
    pg.sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
    try:
        with httpx.Client(base_url=gw.base_url, timeout=30, headers={"authorization": "Bearer sk-alice"}) as http:
            got = http.get(f"/v1/responses/{first.id}")
            assert got.status_code == 503, got.text
            err = got.json()["error"]
            assert err["code"] == "state_store_unavailable" and err["type"] == "server_error"
            assert f"postgresql at 127.0.0.1:{pg.port}/{name}" in err["message"]
        with pytest.raises(openai.InternalServerError):
            alice.responses.create(model="scripted", input="And now?", previous_response_id=first.id)
        unstored = alice.responses.create(model="scripted", input="Still answered.")  # stored it cannot be
        assert unstored.output_text
        assert alice.chat.completions.create(model="scripted", messages=MSG).choices[0].message.content
    finally:
        pg.sql(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
    after = alice.responses.create(model="scripted", input="What is my name?", previous_response_id=first.id)
    assert alice.responses.retrieve(after.id).id == after.id
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)
