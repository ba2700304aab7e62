"""The policy file's tenancy: keys, teams, roles, signed tokens and who may use the admin API
(``keys``, ``teams``, ``access``). Part of :mod:`policies.schema`, which re-exports every name.

A key belongs to a team (optionally) and a user (optionally), and may carry a role, which lets it
use the admin API and the console (:mod:`policies.roles` says what each role may do). A request may
carry a signed token (JWT) instead of a key: ``access.tokens`` says whose keys sign them (a JWKS)
and how its claims map to a team, a user and a role.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from policies.schema_backends import ENV_REF, SHA256
from policies.strict import Strict

Role = Literal["admin", "operator", "viewer", "team_admin"]
ROLES: tuple[Role, ...] = ("admin", "operator", "viewer", "team_admin")
NAME = r"^[A-Za-z0-9_.@-]{1,64}$"  # a team's or a store key's name
# the spend subjects a team's and a user's totals are kept under, beside each key's own name
RESERVED_PREFIXES = ("team:", "user:", "jwt:")
Algorithm = Literal["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
DEFAULT_ALGORITHMS: tuple[Algorithm, ...] = ("RS256", "ES256")


class KeyLimits(Strict):
    """A key's (or a team's) share of the fleet, enforced across every gateway that shares the state store."""

    rpm: int | None = Field(None, ge=1, description="requests per minute (a sliding 60 s window)")
    tpm: int | None = Field(None, ge=1, description="prompt + completion tokens per minute (a sliding 60 s window)")
    budget_per_day: float | None = Field(None, gt=0, description="spend per UTC day, in the prices' currency")
    budget_per_month: float | None = Field(None, gt=0, description="spend per UTC calendar month")

    @property
    def limited(self) -> bool:
        """Whether any limit is set."""
        return not (
            self.rpm is None and self.tpm is None and self.budget_per_day is None and self.budget_per_month is None
        )

    def over(self, outer: KeyLimits) -> list[str]:
        """The limits set here above those of ``outer`` (a key's against its team's), as messages."""
        out = []
        for name in ("rpm", "tpm", "budget_per_day", "budget_per_month"):
            mine, theirs = getattr(self, name), getattr(outer, name)
            if mine is not None and theirs is not None and mine > theirs:
                out.append(f"{name}: {mine:g} is over the team's {theirs:g}")
        return out


class ApiKey(Strict):
    name: str
    sha256: str = Field(description="hex sha256 of the key, or env:NAME holding it")
    models: list[str] | None = Field(None, description="the models and virtual models it may ask for (all: unset)")
    limits: KeyLimits = KeyLimits()
    team: str | None = Field(None, description="the team it belongs to: the team's models and limits hold too")
    user: str | None = Field(None, max_length=256, description="the person or service it stands for (spend per user)")
    role: Role | None = Field(None, description="its role on the admin API and the console (none: neither)")

    @field_validator("sha256")
    @classmethod
    def _hash(cls, v: str) -> str:
        if not (SHA256.match(v) or ENV_REF.match(v)):
            raise ValueError("sha256 must be 64 lowercase hex digits or 'env:NAME'")
        return v

    @model_validator(mode="after")
    def _team_admin(self) -> ApiKey:
        if self.role == "team_admin" and self.team is None:
            raise ValueError("a team_admin key needs a team")
        return self


class TeamSpec(Strict):
    """A team: the models its keys may ask for, and limits that all its keys share."""

    models: list[str] | None = Field(
        None, description="the models and virtual models its keys may ask for (all: unset)"
    )
    limits: KeyLimits = Field(KeyLimits(), description="shared by every key (and token) of the team, fleet-wide")


class TokenClaims(Strict):
    """Which claims of a verified token say who the caller is."""

    user: str = Field("sub", description="the claim naming the user (spend per user, the audit log)")
    team: str = Field("team", description="the claim naming the team (a team of the policy or the admin API)")
    role: str = Field("roles", description="the claim (a string or a list) whose values `roles` maps to a role")


class TokenSpec(Strict):
    """Signed tokens (JWT) accepted in ``Authorization: Bearer`` instead of a key, checked against the
    identity provider's published keys (a JWKS, fetched, cached and fetched again)."""

    jwks_url: str = Field(description="the identity provider's JWKS (https://.../.well-known/jwks.json)")
    issuer: str = Field(min_length=1, description="the `iss` every token must carry")
    audience: str = Field(min_length=1, description="the audience every token's `aud` must name")
    algorithms: list[Algorithm] = Field(
        default_factory=lambda: list(DEFAULT_ALGORITHMS), min_length=1, description="signatures accepted (never `none`)"
    )
    claims: TokenClaims = TokenClaims()
    roles: dict[str, Role] = Field(
        default_factory=dict, description="a role claim's value -> the role it gives (a value not listed gives none)"
    )
    require_team: bool = Field(True, description="refuse a token whose team claim is missing")
    limits: KeyLimits = Field(KeyLimits(), description="each token user's own limits (within the team's)")
    refresh_s: float = Field(300.0, ge=1, le=86400, description="the JWKS is fetched again this often")
    min_refresh_s: float = Field(
        10.0, ge=0, le=3600, description="a token signed by an unknown key fetches the JWKS again at most this often"
    )
    stale_s: float = Field(
        3600.0, ge=0, le=7 * 86400, description="an unreachable provider: the last good keys serve this long, then none"
    )
    timeout_s: float = Field(3.0, gt=0, le=60, description="one fetch of the JWKS")
    leeway_s: float = Field(30.0, ge=0, le=600, description="clock skew allowed on exp, nbf and iat")

    @field_validator("jwks_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("https://", "http://")):
            raise ValueError("jwks_url must start with https:// (or http:// on a trusted network)")
        return v


class Access(Strict):
    """Who sees what, when the policy lists keys."""

    operator_keys: list[str] = Field(
        default_factory=list, description="names of keys (in keys) that see every key's files and batches"
    )
    public_metrics: bool = Field(False, description="serve /metrics without a key (for a scraper)")
    admin_key: str | None = Field(
        None,
        description="hex sha256 of the admin API's own key, or env:NAME holding it: turns on /admin (keys made "
        "there live in the state store) and makes every request need a key",
    )
    tokens: TokenSpec | None = Field(None, description="signed tokens (JWT) accepted instead of keys (off: unset)")

    @field_validator("admin_key")
    @classmethod
    def _admin_hash(cls, v: str | None) -> str | None:
        if v is not None and not (SHA256.match(v) or ENV_REF.match(v)):
            raise ValueError("admin_key must be 64 lowercase hex digits or 'env:NAME'")
        return v
