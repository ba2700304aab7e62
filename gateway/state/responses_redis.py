"""Stored Responses in the fleet's Redis (``state.store: redis``): a ``previous_response_id`` made
on one gateway (or worker) continues on any other that shares the store, with the same rules as
this process's store (``gateway/state/responses.py``): each response belongs to the key that made
it (another key gets the 404 a missing id gets; an operator key reads any), lives ``ttl_s``, and a
key's responses hold at most ``max_bytes_per_owner`` bytes, its oldest dropped first.

Per response: one string (the response, its turns and its owner, as JSON) with its TTL. Per key:
a sorted set of its responses by expiry and a hash of their sizes, which the put script trims, in
one atomic step, to the key's bound. The bound on all keys together is the Redis server's own
(``maxmemory`` with an eviction policy: docs/surfaces.md). A store that fails is a 503
(``StoreDown``) on a read; a put that fails is logged and the answer still goes out (unstored).
"""

from __future__ import annotations

import orjson

from gateway.state.responses import Body, Stored, not_found
from gateway.state.stores import RedisStore

# KEYS: the response, the owner's set by expiry, the owner's sizes. ARGV: the JSON, its TTL (ms),
# its size, the owner's bound (bytes), the id, the prefix of response keys.
_PUT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do redis.call('HDEL', KEYS[3], id) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[5])
redis.call('HSET', KEYS[3], ARGV[5], ARGV[3])
local total = 0
for _, v in ipairs(redis.call('HVALS', KEYS[3])) do total = total + tonumber(v) end
while total > tonumber(ARGV[4]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest then break end
  total = total - tonumber(redis.call('HGET', KEYS[3], oldest) or '0')
  redis.call('ZREM', KEYS[2], oldest)
  redis.call('HDEL', KEYS[3], oldest)
  redis.call('DEL', ARGV[6] .. oldest)
end
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
return total
"""


class RedisResponses:
    def __init__(self, store: RedisStore, ttl_s: float = 3600.0, max_bytes_per_owner: int = 64 * 2**20) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_bytes_per_owner = max_bytes_per_owner
        self._put = store.redis.register_script(_PUT)

    def _owner(self, owner: str | None) -> str:
        return owner or "-"  # a gateway without keys: one owner for all

    async def put(self, response: Body, messages: list[Body], owner: str | None = None) -> None:
        rid = str(response["id"])
        blob = orjson.dumps({"r": response, "m": messages, "o": owner})
        o = self._owner(owner)
        keys = [self.store.key("resp", rid), self.store.key("resp-owner", o), self.store.key("resp-size", o)]
        args: list[str | int | bytes] = [
            blob,
            max(1, int(self.ttl_s * 1000)),
            len(blob),
            self.max_bytes_per_owner,
            rid,
            self.store.key("resp", ""),
        ]
        await self.store.run(self._put(keys=keys, args=args))

    async def get(self, response_id: str, owner: str | None = None, operator: bool = False) -> Stored:
        raw = await self.store.run(self.store.redis.get(self.store.key("resp", response_id)))
        if raw is None:
            raise not_found(response_id)
        item = orjson.loads(raw)
        found = item.get("o")
        if not (operator or found is None or found == owner):
            raise not_found(response_id)
        return Stored(item["r"], item["m"], expires=0.0, owner=found, size=len(raw))

    async def delete(self, response_id: str, owner: str | None = None, operator: bool = False) -> None:
        found = await self.get(response_id, owner, operator)
        o = self._owner(found.owner)
        pipe = self.store.redis.pipeline(transaction=True)
        pipe.delete(self.store.key("resp", response_id))
        pipe.zrem(self.store.key("resp-owner", o), response_id)
        pipe.hdel(self.store.key("resp-size", o), response_id)
        await self.store.run(pipe.execute())

    async def close(self) -> None:
        """Nothing of its own: the client is the state store's, closed with it."""
