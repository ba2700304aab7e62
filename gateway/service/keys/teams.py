"""Teams: the policy's (``teams``) and those the admin API made, which live in the state store so
every gateway sharing it knows them. A team has the models its keys may ask for and limits that
all its keys (and its token users) share, fleet-wide; a key's own limits sit within them.

A store team's record is read at most every ``ttl_s`` per gateway, as a store key's is. The verbs
(made, changed, deleted, listed) are what the admin API and the console both call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from gateway.state.tenancy import Tenancy
from policies.errors import Conflict, InvalidRequest, NotFound
from policies.schema_access import KeyLimits, TeamSpec

log = structlog.get_logger("triage.teams")
CACHE_ENTRIES = 10_000
SUBJECT = "team:"  # a team's limits and spend are kept under "team:NAME" beside its keys' own


def subject(name: str) -> str:
    return SUBJECT + name


def record(name: str, spec: TeamSpec, created_at: float) -> str:
    body = {"name": name, **spec.model_dump(exclude_none=True), "created_at": round(created_at, 3)}
    return orjson.dumps(body).decode()


def as_team(raw: str) -> tuple[TeamSpec, dict[str, Any]]:
    doc = orjson.loads(raw)
    return TeamSpec(models=doc.get("models"), limits=KeyLimits.model_validate(doc.get("limits") or {})), doc


@dataclass
class Teams:
    policy: dict[str, TeamSpec]
    tenancy: Tenancy
    dynamic: bool  # the admin API is on: teams not in the policy are looked up in the store
    ttl_s: float = 0.5
    _seen: dict[str, tuple[float, TeamSpec | None]] = field(default_factory=dict)

    async def get(self, name: str) -> TeamSpec | None:
        """The team named ``name``: the policy's, else the store's (StoreDown: the store failed)."""
        team = self.policy.get(name)
        if team is not None or not self.dynamic:
            return team
        now = time.monotonic()
        seen = self._seen.get(name)
        if seen is None or seen[0] <= now:
            raw = await self.tenancy.team_get(name)
            if len(self._seen) >= CACHE_ENTRIES:
                self._seen.clear()
            seen = self._seen[name] = (now + self.ttl_s, as_team(raw)[0] if raw is not None else None)
        return seen[1]

    def forget(self, name: str) -> None:
        self._seen.pop(name, None)

    async def rows(self, only: str | None = None) -> list[dict[str, Any]]:
        """Every team (or the one named ``only``), the policy's and the store's, by name."""
        out = [_row(n, t, "policy", None) for n, t in self.policy.items() if only in (None, n)]
        for name, raw in (await self.tenancy.team_all()).items() if self.dynamic else ():
            if only in (None, name) and name not in self.policy:
                team, doc = as_team(raw)
                out.append(_row(name, team, "admin", doc.get("created_at")))
        return sorted(out, key=lambda r: r["name"])

    async def put(self, name: str, spec: TeamSpec, public: set[str], new: bool) -> dict[str, Any]:
        """Make (``new``) or change a store team; its models must be the policy's."""
        if name in self.policy:
            raise Conflict(f"'{name}' is a team of the policy: change it in the policy file", param="name")
        if unknown := sorted(set(spec.models or ()) - public):
            raise InvalidRequest(f"no model named {', '.join(unknown)} in the policy", param="models")
        old = await self.tenancy.team_get(name)
        if not new and old is None:
            raise NotFound(f"no team named '{name}'", param="name")
        created = as_team(old)[1].get("created_at", time.time()) if old is not None else time.time()
        if not await self.tenancy.team_put(name, record(name, spec, created), new):
            raise Conflict(f"the team '{name}' exists", param="name")
        self.forget(name)
        log.info("team_saved", team=name, new=new)
        return _row(name, spec, "admin", created)

    async def delete(self, name: str, live_keys: list[str]) -> dict[str, Any]:
        """Delete a store team; refused while a live key belongs to it."""
        if name in self.policy:
            raise Conflict(f"'{name}' is a team of the policy: change it in the policy file", param="name")
        if live_keys:
            raise Conflict(f"the team '{name}' still has live keys: {', '.join(sorted(live_keys))}", param="name")
        if not await self.tenancy.team_delete(name):
            raise NotFound(f"no team named '{name}'", param="name")
        self.forget(name)
        log.info("team_deleted", team=name)
        return {"object": "team", "name": name, "deleted": True}


def _row(name: str, team: TeamSpec, source: str, created_at: float | None) -> dict[str, Any]:
    return {
        "object": "team",
        "name": name,
        "source": source,
        "models": team.models,
        "limits": team.limits.model_dump(exclude_none=True),
        "created_at": created_at,
    }
