"""Stored Responses (``/v1/responses`` with ``store``, the default, as OpenAI's): each response
with the chat turns that led to it, kept for ``ttl_s`` and bounded by count and bytes, for ``GET``
/ ``DELETE /v1/responses/{id}`` and ``previous_response_id``.

Three stores behind one interface (:class:`Responses`): :class:`ResponseStore`, this process's
(the embedded default), and the fleet's, where a chain started on one gateway continues on any
other: ``gateway/state/responses_pg.py``'s where the policy's ``state.database`` names PostgreSQL
(it wins where Redis is set too), else ``gateway/state/responses_redis.py``'s (``state.store:
redis``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from policies.errors import NotFound

Body = dict[str, Any]


@dataclass
class Stored:
    response: Body
    messages: list[Body]  # the chat turns that led to it, its own output included
    expires: float
    owner: str | None = None  # the key's sha256 that made it; None: the gateway runs without keys
    size: int = 0  # bytes of its turns and response, as JSON: what the store's bounds count


class Responses(Protocol):
    async def put(self, response: Body, messages: list[Body], owner: str | None = None) -> None:
        """Keep ``response`` (by its ``id``) with the turns that led to it, for ``owner``."""
        ...

    async def get(self, response_id: str, owner: str | None = None, operator: bool = False) -> Stored:
        """The stored response: :class:`NotFound` when it is missing, expired, or another key's
        (an operator key reads any)."""
        ...

    async def delete(self, response_id: str, owner: str | None = None, operator: bool = False) -> None:
        """As :meth:`get`, then gone."""
        ...

    async def close(self) -> None:
        """What the store holds of its own (a connection pool) let go."""
        ...


def not_found(response_id: str) -> NotFound:
    return NotFound(f"No response with id '{response_id}' is stored (it expired, was deleted or never stored)")


@dataclass
class ResponseStore:
    """Stored responses, by id, for ``ttl_s`` seconds, each with its owner: only the key that made
    one reads, deletes or continues it (another key gets the 404 a missing id gets), or an operator
    key. Bounded by count and by bytes, in all and per key: the oldest go first."""

    ttl_s: float = 3600.0
    capacity: int = 10_000
    max_bytes: int = 256 * 2**20
    max_bytes_per_owner: int = 64 * 2**20
    _items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    _bytes: int = 0
    _owned: dict[str | None, int] = field(default_factory=dict)  # owner -> bytes held
    clock: Callable[[], float] = time.monotonic

    async def put(self, response: Body, messages: list[Body], owner: str | None = None) -> None:
        self._sweep()
        size = len(orjson.dumps(messages)) + len(orjson.dumps(response))
        self._add(response["id"], Stored(response, messages, self.clock() + self.ttl_s, owner, size))
        while len(self._items) > self.capacity or self._bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
        while self._owned.get(owner, 0) > self.max_bytes_per_owner:
            self._drop(next(k for k, v in self._items.items() if v.owner == owner))

    async def get(self, response_id: str, owner: str | None = None, operator: bool = False) -> Stored:
        self._sweep()
        found = self._items.get(response_id)
        if found is None or not (operator or found.owner is None or found.owner == owner):
            raise not_found(response_id)
        return found

    async def delete(self, response_id: str, owner: str | None = None, operator: bool = False) -> None:
        await self.get(response_id, owner, operator)
        self._drop(response_id)

    async def close(self) -> None:
        """Nothing to let go: the responses are this process's memory."""

    @property
    def bytes(self) -> int:
        return self._bytes

    def _add(self, key: str, item: Stored) -> None:
        if key in self._items:
            self._drop(key)
        self._items[key] = item
        self._bytes += item.size
        self._owned[item.owner] = self._owned.get(item.owner, 0) + item.size

    def _drop(self, key: str) -> None:
        item = self._items.pop(key)
        self._bytes -= item.size
        left = self._owned[item.owner] - item.size
        if left > 0:
            self._owned[item.owner] = left
        else:
            del self._owned[item.owner]

    def _sweep(self) -> None:
        now = self.clock()
        while self._items:
            key, oldest = next(iter(self._items.items()))
            if oldest.expires > now:
                break
            self._drop(key)
