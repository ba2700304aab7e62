"""The policy's tenancy sections (issue 55): teams, keys' teams, users and roles, signed tokens;
each problem reported with its place, all at once; a policy without them loads as before."""

from __future__ import annotations

import hashlib

import pytest

from policies import loader
from policies.errors import PolicyInvalid

SHA = hashlib.sha256(b"k").hexdigest()
BASE = """version: 1
backends:
  b: {type: scripted}
models:
  m: {backend: b}
  n: {backend: b}
"""


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyInvalid) as info:
        loader.parse(text, "p.yaml")
    return info.value.problems


def test_teams_keys_and_tokens_load() -> None:
    policy = loader.parse(
        BASE
        + f"""teams:
  red: {{models: [m], limits: {{rpm: 10, budget_per_day: 2}}}}
keys:
  - {{name: a, sha256: "{SHA}", team: red, user: ada, role: team_admin, models: [m], limits: {{rpm: 5}}}}
access:
  tokens: {{jwks_url: "https://idp.test/jwks", issuer: "https://idp.test", audience: triage,
            roles: {{ops: operator}}, limits: {{rpm: 2}}}}
"""
    )
    key = policy.keys[0]
    assert (key.team, key.user, key.role) == ("red", "ada", "team_admin")
    tokens = policy.access.tokens
    assert tokens is not None and tokens.algorithms == ["RS256", "ES256"] and tokens.claims.user == "sub"
    assert loader.parse(BASE).teams == {}  # nothing of this is needed


def test_each_tenancy_problem_is_reported_with_its_place() -> None:
    fields = "\n".join(
        problems(
            BASE
            + f"""keys:
  - {{name: c, sha256: "{SHA}", role: team_admin}}
  - {{name: d, sha256: "{SHA}", role: root}}
access:
  tokens: {{jwks_url: "ftp://idp", issuer: i, audience: a, algorithms: [RS256, none]}}
"""
        )
    )
    for expected in (
        "keys[0]: Value error, a team_admin key needs a team",
        "keys[1].role: Input should be 'admin'",
        "access.tokens.jwks_url: Value error, jwks_url must start with https://",
        "access.tokens.algorithms[1]: Input should be 'RS256'",
    ):
        assert expected in fields, (expected, fields)
    references = "\n".join(
        problems(
            BASE
            + f"""teams:
  red: {{models: [m, nope], limits: {{rpm: 10}}}}
  "bad name": {{}}
keys:
  - {{name: a, sha256: "{SHA}", team: blue}}
  - {{name: b, sha256: "{SHA}", team: red, models: [n], limits: {{rpm: 50}}}}
  - {{name: "team:x", sha256: "{SHA}"}}
"""
        )
    )
    for expected in (
        "teams.red.models[1]: model 'nope' is not defined",
        "teams.bad name: a team's name is 1 to 64 letters",
        "keys[0].team: team 'blue' is not defined in teams",
        "keys[1].models[0]: model 'n' is not one of team red's",
        "keys[1].limits: rpm: 50 is over the team's 10",
        "keys[2].name: a key's name may not start with team:",
    ):
        assert expected in references, (expected, references)
