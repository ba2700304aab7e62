"""The tenancy's cross-references (part of :func:`policies.references.reference_problems`): a key's
team exists and its models and limits sit within the team's; teams' names and models; key names
that would collide with the spend kept per team, user and token."""

from __future__ import annotations

import re

from policies.schema import Loc, Policy
from policies.schema_access import NAME, RESERVED_PREFIXES

_NAME = re.compile(NAME)


def access_problems(policy: Policy) -> list[tuple[Loc, str]]:
    problems: list[tuple[Loc, str]] = []
    public = {*policy.models, *policy.virtual_models}
    for name, team in policy.teams.items():
        if not _NAME.match(name):
            problems.append((("teams", name), "a team's name is 1 to 64 letters, digits or _ . @ -"))
        for j, model in enumerate(team.models or []):
            if model not in public:
                problems.append((("teams", name, "models", j), f"model '{model}' is not defined"))
    for i, key in enumerate(policy.keys):
        if key.name.startswith(RESERVED_PREFIXES):
            problems.append((("keys", i, "name"), f"a key's name may not start with {', '.join(RESERVED_PREFIXES)}"))
        if key.team is None:
            continue
        found = policy.teams.get(key.team)
        if found is None:
            problems.append((("keys", i, "team"), f"team '{key.team}' is not defined in teams"))
            continue
        if found.models is not None:
            for j, model in enumerate(key.models or []):
                if model not in found.models:
                    problems.append((("keys", i, "models", j), f"model '{model}' is not one of team {key.team}'s"))
        problems.extend((("keys", i, "limits"), msg) for msg in key.limits.over(found.limits))
    tokens = policy.access.tokens
    if tokens is not None and tokens.limits.limited:
        for name, team in policy.teams.items():
            problems.extend(
                (("access", "tokens", "limits"), f"team {name}: {m}") for m in tokens.limits.over(team.limits)
            )
    return problems
