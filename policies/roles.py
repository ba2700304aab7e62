"""Who may do what on the admin API and the console: one table, read by both. Pure: no I/O.

Each action is allowed to a role over ``all`` objects, over its own ``team``'s only, or not at all
(absent). A principal is whoever sent the request: the admin key (role ``admin``), a key with a
role, or a signed token whose claims map to one. :func:`decide` is the only check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from policies.schema_access import ROLES, Role

Action = Literal[
    "keys.read",
    "keys.write",
    "teams.read",
    "teams.write",
    "spend.read",
    "audit.read",
    "traffic.read",
    "quality.read",
    "policy.reload",
]
Scope = Literal["all", "team"]

# action -> role -> scope; a role not listed may not do it
TABLE: dict[Action, dict[Role, Scope]] = {
    "keys.read": {"admin": "all", "operator": "all", "viewer": "all", "team_admin": "team"},
    "keys.write": {"admin": "all", "operator": "all", "team_admin": "team"},
    "teams.read": {"admin": "all", "operator": "all", "viewer": "all", "team_admin": "team"},
    "teams.write": {"admin": "all", "operator": "all"},
    "spend.read": {"admin": "all", "operator": "all", "viewer": "all", "team_admin": "team"},
    "audit.read": {"admin": "all", "operator": "all"},
    "traffic.read": {"admin": "all", "operator": "all", "viewer": "all"},
    "quality.read": {"admin": "all", "operator": "all", "viewer": "all"},
    "policy.reload": {"admin": "all"},
}
ACTIONS: tuple[Action, ...] = tuple(TABLE)

# the roles a role may give a key it makes (nobody gives more than it has)
GRANTS: dict[Role, tuple[Role, ...]] = {
    "admin": ROLES,
    "operator": ("viewer", "team_admin"),
    "viewer": (),
    "team_admin": (),
}


@dataclass(frozen=True)
class Principal:
    """Who sent an admin request: a name for the audit log, a role, and the team it belongs to."""

    name: str
    role: Role
    team: str | None = None
    user: str | None = None
    via: Literal["admin_key", "key", "token"] = "key"


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    scope: Scope | None  # what the principal sees of the action's objects (None: refused)
    reason: str = ""


def decide(who: Principal, action: Action, team: str | None = None) -> Verdict:
    """Whether ``who`` may do ``action`` on an object of ``team`` (None: no one team's, such as every
    key at once: a team-scoped principal then sees only its own team's)."""
    scope = TABLE[action].get(who.role)
    if scope is None:
        return Verdict(False, None, f"the role {who.role} may not do {action}")
    if scope == "team" and (who.team is None or (team is not None and team != who.team)):
        return Verdict(False, None, f"a {who.role} acts only on its own team's objects")
    return Verdict(True, scope)


def may_grant(who: Principal, role: Role | None) -> bool:
    """Whether ``who`` may make a key with ``role`` (None: a key with no role, which any key maker may)."""
    return role is None or role in GRANTS[who.role]


def table_rows() -> list[tuple[str, dict[Role, str]]]:
    """The table as rows (docs, the console): each action with every role's word for it."""
    words = {"all": "yes", "team": "own team"}
    return [(action, {role: words.get(by.get(role, ""), "no") for role in ROLES}) for action, by in TABLE.items()]
