"""Who is calling: a bearer key's sha256 looked up among the policy's keys, then (with the admin
API on) among the keys the admin API made, which live in the state store.

A store key's record is read at most every ``ttl_s`` seconds per key on each gateway, so a key
revoked through any gateway is refused by every gateway sharing the store within that time (the
revocation is a timestamp, compared on every request, so a rotation's grace period ends on time
even from the cache). A policy key costs a dict lookup and no store call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from gateway.state.stores import Store
from policies.schema import ApiKey, KeyLimits

log = structlog.get_logger("triage.keys")
CACHE_ENTRIES = 50_000  # distinct keys remembered per gateway before the memory is cleared


def record(name: str, digest: str, models: list[str] | None, limits: KeyLimits, created_at: float) -> str:
    """A store key's record, as kept (no secret: its sha256 only)."""
    return orjson.dumps(
        {
            "name": name,
            "sha256": digest,
            "models": models,
            "limits": limits.model_dump(exclude_none=True),
            "created_at": round(created_at, 3),
        }
    ).decode()


def as_key(raw: str) -> tuple[ApiKey, dict[str, Any]]:
    """A kept record as the policy's key type, and the record itself."""
    doc = orjson.loads(raw)
    limits = KeyLimits.model_validate(doc.get("limits") or {})
    key = ApiKey(name=doc["name"], sha256=doc["sha256"], models=doc.get("models"), limits=limits)
    return key, doc


@dataclass
class Keyring:
    policy_keys: dict[str, ApiKey]  # sha256 -> key
    store: Store
    dynamic: bool  # the admin API is on: keys not in the policy are looked up in the store
    ttl_s: float = 0.5
    _seen: dict[str, tuple[float, ApiKey | None, float | None]] = field(default_factory=dict)

    @property
    def required(self) -> bool:
        """Every request needs a key: the policy lists some, or the admin API may make them."""
        return self.dynamic or bool(self.policy_keys)

    async def lookup(self, digest: str) -> ApiKey | None:
        """The live key with this sha256; None when unknown or revoked (StoreDown: the store failed)."""
        key, revoked_at = await self._known(digest)
        if key is None or (revoked_at is not None and revoked_at <= time.time()):
            return None
        return key

    async def name_of(self, digest: str) -> str | None:
        """The name of the key with this sha256, live or revoked (what its spend is kept under)."""
        key = await self.owner(digest)
        return key.name if key is not None else None

    async def owner(self, digest: str) -> ApiKey | None:
        """The key with this sha256, live or revoked (a batch it made runs under its models)."""
        key, _ = await self._known(digest)
        return key

    async def _known(self, digest: str) -> tuple[ApiKey | None, float | None]:
        """The key with this sha256 and when it is or was revoked: the policy's, else the store's,
        read at most every ``ttl_s`` (a batch's lines, or a client's requests, share one read)."""
        key = self.policy_keys.get(digest)
        if key is not None or not self.dynamic:
            return key, None
        now = time.monotonic()
        seen = self._seen.get(digest)
        if seen is None or seen[0] <= now:
            raw, revoked_at = await self.store.key_get(digest)
            found = as_key(raw)[0] if raw is not None else None
            if len(self._seen) >= CACHE_ENTRIES:
                self._seen.clear()
            seen = self._seen[digest] = (now + self.ttl_s, found, revoked_at)
        return seen[1], seen[2]

    def forget(self, digest: str) -> None:
        """Drop a key from this gateway's memory (the admin API changed it here)."""
        self._seen.pop(digest, None)
