"""Who is calling: a bearer key's sha256 looked up among the policy's keys, then (with the admin
API on) among the keys the admin API made, which live in the state store; or a signed token
(``access.tokens``), checked by :mod:`gateway.service.keys.tokens`, standing for a user of a team.

A key of a team is handed out with the team's models applied (its own, where it lists some, less
those the team may not use); the team's limits are checked beside the key's
(:mod:`gateway.service.keys.quotas`). A token's caller is a key made on the fly: named
``jwt:USER``, its sha256 the hash of the token's issuer and subject (what its files, batches and
stored Responses belong to, across its tokens), the policy's ``access.tokens.limits``, its team's.

A store key's record is read at most every ``ttl_s`` seconds per key on each gateway, so a key
revoked through any gateway is refused by every gateway sharing the store within that time (the
revocation is a timestamp, compared on every request, so a rotation's grace period ends on time
even from the cache). A policy key costs a dict lookup and no store call.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from gateway.service.keys.teams import Teams
from gateway.service.keys.tokens import Identity, Tokens, looks_like
from gateway.state.stores import Store, StoreDown
from gateway.state.tenancy import open_tenancy
from policies.errors import Unauthorized
from policies.schema import ApiKey, KeyLimits, Policy

log = structlog.get_logger("triage.keys")
CACHE_ENTRIES = 50_000  # distinct keys remembered per gateway before the memory is cleared


def record(
    name: str, digest: str, models: list[str] | None, limits: KeyLimits, created_at: float, **tenancy: str | None
) -> str:
    """A store key's record, as kept (no secret: its sha256 only); ``tenancy``: its team, user and
    role, where set."""
    body: dict[str, Any] = {
        "name": name,
        "sha256": digest,
        "models": models,
        "limits": limits.model_dump(exclude_none=True),
        "created_at": round(created_at, 3),
    }
    body.update({k: v for k, v in tenancy.items() if k in ("team", "user", "role") and v is not None})
    return orjson.dumps(body).decode()


def as_key(raw: str) -> tuple[ApiKey, dict[str, Any]]:
    """A kept record as the policy's key type, and the record itself."""
    doc = orjson.loads(raw)
    limits = KeyLimits.model_validate(doc.get("limits") or {})
    key = ApiKey(
        name=doc["name"],
        sha256=doc["sha256"],
        models=doc.get("models"),
        limits=limits,
        team=doc.get("team"),
        user=doc.get("user"),
        role=doc.get("role"),
    )
    return key, doc


def within(key: ApiKey, team_models: list[str] | None) -> ApiKey:
    """``key`` with its team's models applied (unchanged when the team lists none)."""
    if team_models is None:
        return key
    models = list(team_models) if key.models is None else [m for m in key.models if m in team_models]
    return key.model_copy(update={"models": models})


@dataclass
class Keyring:
    policy_keys: dict[str, ApiKey]  # sha256 -> key
    store: Store
    dynamic: bool  # the admin API is on: keys not in the policy are looked up in the store
    teams: Teams
    tokens: Tokens | None = None  # signed tokens accepted (policy: access.tokens)
    token_limits: KeyLimits = field(default_factory=KeyLimits)
    ttl_s: float = 0.5
    _seen: dict[str, tuple[float, ApiKey | None, float | None]] = field(default_factory=dict)
    _callers: dict[str, ApiKey] = field(default_factory=dict)  # token subjects seen -> their key

    @property
    def required(self) -> bool:
        """Every request needs a key: the policy lists some, the admin API may make them, or tokens
        are accepted."""
        return self.dynamic or bool(self.policy_keys) or self.tokens is not None

    async def caller(self, authorization: str | None) -> ApiKey | None:
        """Who sent ``Authorization: Bearer ...``: a live key, or a verified token's caller (its team
        known); None when neither (Unauthorized from a bad token, whose reason is logged)."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        credential = authorization[7:].strip()
        if self.tokens is not None and looks_like(credential):
            return await self._token_caller(await self.tokens.verify(credential))
        return await self.lookup(hashlib.sha256(credential.encode()).hexdigest())

    def token_subject(self, credential: str) -> str | None:
        """A signed token's subject (see :meth:`Tokens.subject_of`); None for a key."""
        return self.tokens.subject_of(credential) if self.tokens is not None else None

    async def _token_caller(self, who: Identity) -> ApiKey | None:
        if who.team is not None and await self.teams.get(who.team) is None:
            log.warning("token_refused", reason=f"unknown team {who.team[:64]!r}", user=who.user[:64])
            raise Unauthorized("Invalid or expired token")
        key = ApiKey(
            name=f"jwt:{who.user}",
            sha256=who.subject,
            limits=self.token_limits,
            team=who.team,
            user=who.user,
            role=who.role,
        )
        if self._callers.get(who.subject) != key:  # new to this gateway, or changed: kept for the fleet
            await self._keep_caller(key)
        return await self._with_team(key)

    async def _keep_caller(self, key: ApiKey) -> None:
        """A token's caller kept in the store (what its batches run as on any gateway) and here."""
        if len(self._callers) >= CACHE_ENTRIES:
            self._callers.clear()
        self._callers[key.sha256] = key
        try:
            await self.teams.tenancy.caller_put(key.sha256, key.model_dump_json(exclude_none=True))
        except StoreDown as exc:  # its requests are served; a batch on another gateway would not know it
            log.warning("token_caller_not_kept", user=(key.user or "")[:64], error=exc.message)

    async def _with_team(self, key: ApiKey | None) -> ApiKey | None:
        """``key`` with its team's models applied; None when its team is gone."""
        if key is None or key.team is None:
            return key
        team = await self.teams.get(key.team)
        return None if team is None else within(key, team.models)

    async def lookup(self, digest: str) -> ApiKey | None:
        """The live key with this sha256; None when unknown or revoked (StoreDown: the store failed)."""
        key, revoked_at = await self._known(digest)
        if key is None or (revoked_at is not None and revoked_at <= time.time()):
            return None
        return await self._with_team(key)

    async def name_of(self, digest: str) -> str | None:
        """The name of the key with this sha256, live or revoked (what its spend is kept under)."""
        key = await self.owner(digest)
        return key.name if key is not None else None

    async def owner(self, digest: str) -> ApiKey | None:
        """The key with this sha256, live or revoked (a batch it made runs under its models), or a
        token's caller (any gateway of the fleet has seen)."""
        key, _ = await self._known(digest)
        if key is None and (key := self._callers.get(digest)) is None and self.tokens is not None:
            raw = await self.teams.tenancy.caller_get(digest)
            key = ApiKey.model_validate_json(raw) if raw is not None else None
        return await self._with_team(key)

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


def admin_api(policy: Policy) -> bool:
    """Whether the admin API (and the console) is on: an admin key, a key with a role, or signed
    tokens (whose claims may give one)."""
    return policy.access.admin_key is not None or policy.access.tokens is not None or any(k.role for k in policy.keys)


def keyring_for(policy: Policy, by_digest: dict[str, ApiKey], store: Store, admin_key: bool) -> Keyring:
    """The keyring of ``policy``: its keys (by sha256), its teams and tokens, and (with the admin API
    on) the store's keys and teams."""
    dynamic = admin_key or admin_api(policy)
    teams = Teams(dict(policy.teams), open_tenancy(store), dynamic)
    spec = policy.access.tokens
    tokens = Tokens(spec) if spec is not None else None
    limits = spec.limits if spec is not None else KeyLimits()
    return Keyring(by_digest, store, dynamic, teams, tokens, limits)
