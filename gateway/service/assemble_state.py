"""The fleet's state a runtime opens (:func:`gateway.service.assemble.build`): the state store, the
stored Responses (PostgreSQL or Redis), the console's shared ring and the cascade's shared memory,
each the previous runtime's while the policy's settings for it are unchanged."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog

from gateway.service.keys.keyring import as_key
from gateway.state.memory_redis import MemoryFeed
from gateway.state.recent_redis import RecentFeed
from gateway.state.responses import Responses
from gateway.state.responses_redis import RedisResponses
from gateway.state.stores import RedisStore, Store, StoreDown, open_store
from policies.errors import PolicyInvalid
from policies.memory import Memory
from policies.schema import Policy

if TYPE_CHECKING:
    from gateway.service.runtime import Runtime

log = structlog.get_logger("triage.runtime")


async def open_state(policy: Policy, previous: Runtime | None, admin: str | None) -> tuple[Store, str | None]:
    """The state store (the previous one while the policy's ``state`` is unchanged), and a problem
    when it is down and the policy lets the gateway start degraded."""
    if previous is not None and previous.policy.state == policy.state:
        store, problem = previous.store, previous.store_problem
    else:
        try:
            store, problem = await open_store(policy.state)
        except StoreDown as exc:
            raise PolicyInvalid([f"state: {exc.message}"]) from None
        if problem is not None:
            log.warning("state_store_down", store=policy.state.store, problem=problem, mode="degraded")
    if admin is not None and problem is None:
        try:
            await _names_apart(policy, store)
        except PolicyInvalid:
            if previous is None or store is not previous.store:
                await store.close()
            raise
    return store, problem


async def _names_apart(policy: Policy, store: Store) -> None:
    """A policy key may not take the name of a live key the admin API made: the two would share
    rate windows and spend (both are kept by name)."""
    try:
        live = {as_key(raw)[0].name for raw, revoked_at in await store.key_all() if revoked_at is None}
    except StoreDown:
        return  # found when the store answers again: the admin API refuses a policy key's name
    if clash := sorted(live & {k.name for k in policy.keys}):
        names = ", ".join(clash)
        raise PolicyInvalid([f"keys: {names}: also the name of a live key made by the admin API (revoke it first)"])


async def responses_for(
    policy: Policy, previous: Runtime | None, store: Store, close: Callable[[], Awaitable[None]]
) -> Responses | None:
    """Stored Responses in the fleet's store: PostgreSQL where ``state.database`` names it (the
    previous runtime's while it is unchanged), else Redis where ``state.store`` is; None: the
    app's own (this process). PostgreSQL wins where both are set: it keeps them on disk and bounds
    all keys' together itself (Redis only by its ``maxmemory``). What this start opened is closed
    when the database cannot be reached."""
    database = policy.state.database
    if database is None:
        return RedisResponses(store) if isinstance(store, RedisStore) else None
    if previous is not None and previous.responses is not None and previous.policy.state.database == database:
        return previous.responses
    from gateway.state.pg import database_dsn
    from gateway.state.responses_pg import PgResponses

    try:
        return await PgResponses.open(database_dsn(policy.state))
    except StoreDown as exc:
        await close()
        raise PolicyInvalid([f"state.database: {exc.message}"]) from None


def recent_for(policy: Policy, previous: Runtime | None, store: Store) -> RecentFeed | None:
    """The console's ring shared by the fleet, where the state is (Redis) and the console on (and
    ``console.shared``): the previous runtime's while the store is the same (its bound the policy's
    ``console.recent``)."""
    if not isinstance(store, RedisStore) or not (policy.console.enabled and policy.console.shared):
        return None
    feed = previous.recent if previous is not None and previous.store is store else None
    if feed is None:
        return RecentFeed(store, policy.console.recent)
    feed.size = policy.console.recent
    return feed


def memory_feed_for(policy: Policy, previous: Runtime | None, store: Store, memory: Memory | None) -> MemoryFeed | None:
    """The cascade's memory shared by the fleet, where the state is (Redis) and the memory
    ``shared``: the previous runtime's while it feeds the same ring through the same store."""
    spec = policy.cascade.memory if policy.cascade is not None else None
    if memory is None or spec is None or not spec.shared or policy.classifier is None:
        return None
    if not isinstance(store, RedisStore):
        return None
    layers = policy.classifier.encoder.layers
    old = previous.memory_feed if previous is not None else None
    if (
        old is not None
        and old.store is store
        and old.memory is memory
        and old.key == store.key("memory", f"layers-{layers}")
    ):
        return old
    return MemoryFeed(store, memory, layers)
