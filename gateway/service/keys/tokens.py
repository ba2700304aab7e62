"""Signed tokens (JWT) instead of keys (policy: ``access.tokens``), checked with PyJWT against the
identity provider's published keys (its JWKS).

The JWKS is fetched on first use and again every ``refresh_s``; a token signed by a key it does not
list fetches it again at once (at most every ``min_refresh_s``: a stream of made-up key ids cannot
hammer the provider), so a provider's rotated keys are picked up without a restart. A provider that
cannot be reached keeps its last good keys serving for ``stale_s`` past the refresh that failed,
then nothing: every token is refused (503, ``identity_provider_unavailable``) until a fetch succeeds.

A token passes when its header names an algorithm the policy accepts (never ``none``, never a
symmetric one) and a key of the set of the same family, its signature verifies, and its ``iss``,
``aud`` and ``exp`` (and ``nbf`` where present) hold, within ``leeway_s``. Any other token is a 401
whose message says nothing of why; the reason goes to the log (never the token).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import structlog

from policies.errors import NotReady, Unauthorized
from policies.schema_access import Role, TokenSpec

if TYPE_CHECKING:  # PyJWT (and cryptography under it, about 80 ms to import): only where tokens are on
    import jwt

log = structlog.get_logger("triage.tokens")
MAX_JWKS_BYTES = 1 << 20
RETRY_S = 1.0  # a failed fetch is not tried again sooner
PASSED_ENTRIES = 10_000  # tokens that passed, remembered (then forgotten all at once)
REFUSED = "Invalid or expired token"  # all a refused token's sender is told
ROLE_RANK: tuple[Role, ...] = ("admin", "operator", "team_admin", "viewer")  # the strongest mapped role wins
_FAMILIES = {"RSA": ("RS", "PS"), "EC": ("ES",), "OKP": ("EdDSA",)}
_CURVES = {"ES256": "P-256", "ES384": "P-384", "ES512": "P-521"}


class ProviderDown(NotReady):
    default_code = "identity_provider_unavailable"


class BadToken(Exception):
    """Why a token is refused (logged, never sent)."""


def looks_like(token: str) -> bool:
    """Whether a bearer credential is a JWT (a compact JWS: three dot-separated parts, a JSON header)."""
    return token.startswith("eyJ") and token.count(".") == 2


@dataclass(frozen=True)
class Identity:
    """Who a verified token says the caller is."""

    subject: str  # iss and sub, hashed: stable across the user's tokens (what their objects belong to)
    user: str
    team: str | None
    role: Role | None
    expires: float


@dataclass
class Tokens:
    spec: TokenSpec
    _keys: dict[str, _Key] = field(default_factory=dict)  # kid ("" for none) -> key
    _good_at: float | None = None  # monotonic time of the last fetch that succeeded
    _tried_at: float = -1e9  # of the last fetch tried
    _forced_at: float = -1e9  # of the last fetch an unknown key asked for
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _passed: dict[str, tuple[Identity, str]] = field(default_factory=dict)  # token -> who, and its key's id

    async def verify(self, token: str) -> Identity:
        """The identity a token stands for; Unauthorized (401) for any bad token, ProviderDown (503)
        when the provider's keys are unknown or too old to trust. A token that passed is not checked
        again while the keys are fresh, the key that signed it is still published and it has not
        expired (a client sends the same token many times: a check costs about 0.3 ms)."""
        now = time.monotonic()
        hit = self._passed.get(token)
        fresh = self._good_at is not None and now < self._good_at + self.spec.refresh_s
        if hit is not None and fresh and hit[1] in self._keys and time.time() < hit[0].expires:
            return hit[0]
        try:
            identity, kid = await self._verify(token)
        except BadToken as exc:
            log.warning("token_refused", reason=str(exc), issuer=self.spec.issuer)
            raise Unauthorized(REFUSED) from None
        if len(self._passed) >= PASSED_ENTRIES:
            self._passed.clear()
        self._passed[token] = (identity, kid)
        return identity

    async def _verify(self, token: str) -> tuple[Identity, str]:
        import jwt

        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise BadToken(f"malformed: {type(exc).__name__}") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.spec.algorithms:
            raise BadToken(f"algorithm {str(alg)[:16]!r} is not accepted")
        raw_kid = header.get("kid")
        kid = raw_kid if isinstance(raw_kid, str) else ""
        key = await self._key(kid)
        if not key.fits(alg):
            raise BadToken(f"algorithm {alg} does not fit the key {kid[:64]!r}")
        try:
            claims = jwt.decode(
                token,
                key.jwk.key,
                algorithms=[alg],
                audience=self.spec.audience,
                issuer=self.spec.issuer,
                leeway=self.spec.leeway_s,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise BadToken("expired") from None
        except jwt.InvalidAudienceError:
            raise BadToken("another audience") from None
        except jwt.InvalidIssuerError:
            raise BadToken("another issuer") from None
        except jwt.PyJWTError as exc:
            raise BadToken(f"{type(exc).__name__}: {str(exc)[:120]}") from None
        return self._identity(claims), (kid if kid in self._keys else next(iter(self._keys), ""))

    def _identity(self, claims: dict[str, Any]) -> Identity:
        names = self.spec.claims
        user, team = claims.get(names.user), claims.get(names.team)
        if not isinstance(user, str) or not user or len(user) > 256:
            raise BadToken(f"no usable '{names.user}' claim")
        if team is not None and not isinstance(team, str):
            raise BadToken(f"the '{names.team}' claim is not a string")
        if team is None and self.spec.require_team:
            raise BadToken(f"no '{names.team}' claim")
        raw = claims.get(names.role)
        values = (
            [raw] if isinstance(raw, str) else [v for v in raw if isinstance(v, str)] if isinstance(raw, list) else []
        )
        mapped = {self.spec.roles[v] for v in values if v in self.spec.roles}
        role = next((r for r in ROLE_RANK if r in mapped and (r != "team_admin" or team is not None)), None)
        return Identity(self._subject(claims), user, team, role, float(claims["exp"]))

    def _subject(self, claims: dict[str, Any]) -> str:
        sub = claims.get("sub")
        sub = sub if isinstance(sub, str) else claims.get(self.spec.claims.user)
        return hashlib.sha256(f"jwt|{self.spec.issuer}|{sub}".encode()).hexdigest()

    def subject_of(self, token: str) -> str | None:
        """The subject of a token :meth:`verify` has passed (what its caller's objects belong to):
        its claims read again without the signature, so only for a token already verified."""
        if not looks_like(token):
            return None
        import jwt

        try:
            return self._subject(jwt.decode(token, options={"verify_signature": False}))
        except jwt.PyJWTError:
            return None

    # -- the provider's keys ------------------------------------------------------------------------

    def _usable(self, now: float) -> bool:
        s = self.spec
        return self._good_at is not None and now <= self._good_at + s.refresh_s + s.stale_s

    async def _key(self, kid: str) -> _Key:
        now = time.monotonic()
        if self._good_at is None or now >= self._good_at + self.spec.refresh_s:
            await self._refresh(wait=not self._usable(now))
        key = self._find(kid)
        if key is None and now - self._forced_at >= self.spec.min_refresh_s:
            self._forced_at = now
            await self._refresh(wait=True, forced=True)
            key = self._find(kid)
        if not self._usable(time.monotonic()):
            raise ProviderDown("the identity provider's keys cannot be fetched: tokens cannot be checked")
        if key is None:
            raise BadToken(f"signed by an unknown key {kid[:64]!r}")
        return key

    def _find(self, kid: str) -> _Key | None:
        if kid or len(self._keys) != 1:
            return self._keys.get(kid)
        return next(iter(self._keys.values()))

    async def _refresh(self, wait: bool, forced: bool = False) -> None:
        """Fetch the JWKS (one fetch at a time; without ``wait``, not when one is under way)."""
        import jwt

        if self._lock.locked() and not wait:
            return
        started = time.monotonic()
        async with self._lock:
            if self._good_at is not None and self._good_at >= started:
                return  # fetched while this one waited
            if started - self._tried_at < RETRY_S and not forced:
                return
            self._tried_at = time.monotonic()
            try:
                self._keys = await self._fetch()
            except (httpx.HTTPError, ValueError, jwt.PyJWTError) as exc:
                log.warning("jwks_fetch_failed", url=self.spec.jwks_url, error=f"{type(exc).__name__}: {exc}"[:300])
                return
            self._good_at = time.monotonic()
            log.info("jwks_fetched", url=self.spec.jwks_url, keys=sorted(self._keys), forced=forced)

    async def _fetch(self) -> dict[str, _Key]:
        import jwt

        async with httpx.AsyncClient(timeout=self.spec.timeout_s, follow_redirects=False) as client:
            r = await client.get(self.spec.jwks_url, headers={"accept": "application/json"})
        r.raise_for_status()
        if len(r.content) > MAX_JWKS_BYTES:
            raise ValueError(f"the JWKS is over {MAX_JWKS_BYTES} bytes")
        doc = r.json()
        if not isinstance(doc, dict):
            raise ValueError("the JWKS is not a JSON object")
        keys: dict[str, _Key] = {}
        for data in doc.get("keys") or []:
            if not isinstance(data, dict) or data.get("kty") not in _FAMILIES:  # never a symmetric key
                continue
            try:
                keys[str(data.get("kid") or "")] = _Key(jwt.PyJWK(data), data)
            except jwt.PyJWTError as exc:
                log.warning("jwks_key_skipped", kid=str(data.get("kid"))[:64], error=str(exc)[:200])
        if not keys:
            raise ValueError("the JWKS holds no usable public key")
        return keys


@dataclass(frozen=True)
class _Key:
    jwk: jwt.PyJWK
    data: dict[str, Any]  # the JWK as published

    def fits(self, alg: str) -> bool:
        """Whether ``alg`` may be verified with this key: its own ``alg`` where it names one, else its
        family (and an EC key's curve)."""
        if isinstance(self.data.get("alg"), str) and self.data["alg"] != alg:
            return False
        if not alg.startswith(_FAMILIES[self.data["kty"]]):
            return False
        return alg not in _CURVES or self.data.get("crv") == _CURVES[alg]
