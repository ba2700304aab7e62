"""The console's login: a session cookie signed by the gateway, and the checks on every write.

A login with the admin key (``access.admin_key``) gets a cookie ``<expiry>.<nonce>.<signature>``:
HMAC-SHA256 under the console's secret over the admin key's sha256, the expiry and the nonce. A
login with a key that has a role gets ``<expiry>.<nonce>.<signature>.<the key's sha256>``, signed
the same way over that sha256: each page asks again whether that key is live and what its role is
(:mod:`gateway.service.keys.access`), so a revoked key's session ends with it. It is
``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page sends it), ``Path=/console``
and ``Secure`` on HTTPS. Nothing is kept on the server: every gateway process that shares the secret
accepts it, and a new admin key in the policy ends every session (the digest is signed). A cookie
forged, altered or past its expiry is no session. The key itself is never in the cookie or a URL.

Writes (a login, a key made, revoked or rotated) also need the request's ``Origin`` (else its
``Referer``) to be this gateway's own host, and, once logged in, the session's CSRF token in the
form: a cross-site request is refused even from a browser that ignores SameSite.

The secret: ``TRIAGE_CONSOLE_SECRET`` where set (a fleet behind one load balancer sets the same),
else 32 random bytes made once in the triage cache folder (mode 0600), shared by the workers of one
machine.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from policies.paths import cache_dir
from policies.roles import Principal

COOKIE = "triage_console"
SECRET_ENV = "TRIAGE_CONSOLE_SECRET"


@functools.cache
def secret() -> bytes:
    """The key sessions are signed with (see the module's doc)."""
    if env := os.environ.get(SECRET_ENV):
        return hashlib.sha256(env.encode()).digest()
    path = cache_dir() / "console-secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            data = path.read_bytes()
            if len(data) >= 32:
                return data[:32]
            path.unlink(missing_ok=True)  # torn by a start that died while writing it: made again
            continue
        data = secrets.token_bytes(32)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return data
    raise OSError(f"could not make the console's secret in {path}")


@dataclass(frozen=True)
class Session:
    nonce: str
    expires: float
    subject: str = ""  # the sha256 of the key logged in with (the admin key's, or a key with a role)
    who: Principal | None = None  # whom the subject stands for now (the console asks on every page)

    def csrf(self, key: bytes) -> str:
        """The token the session's forms carry."""
        return hmac.new(key, f"csrf|{self.nonce}".encode(), hashlib.sha256).hexdigest()[:32]


def _sign(key: bytes, admin_digest: str, expires: int, nonce: str) -> str:
    return hmac.new(key, f"{admin_digest}|{expires}|{nonce}".encode(), hashlib.sha256).hexdigest()


def issue(
    key: bytes, subject: str, ttl_s: float, now: float | None = None, carried: bool = False
) -> tuple[str, Session]:
    """A new session for ``subject`` (the sha256 of the key logged in with): the cookie's value, and
    the session it stands for. ``carried``: the subject is written in the cookie (a key with a role);
    else it is the admin key's, known to the gateway."""
    expires = int((time.time() if now is None else now) + ttl_s)
    nonce = secrets.token_urlsafe(16)
    value = f"{expires}.{nonce}.{_sign(key, subject, expires, nonce)}" + (f".{subject}" if carried else "")
    return value, Session(nonce, float(expires), subject)


def check(key: bytes, admin_digest: str | None, value: str | None, now: float | None = None) -> Session | None:
    """The session a cookie stands for; None when it is missing, forged, altered or expired."""
    if not value or len(value) > 256:
        return None
    parts = value.split(".")
    if len(parts) not in (3, 4) or not parts[0].isascii() or not parts[0].isdigit():
        return None
    expires, nonce, sig = int(parts[0]), parts[1], parts[2]
    subject = parts[3] if len(parts) == 4 else admin_digest
    if not subject or not hmac.compare_digest(sig, _sign(key, subject, expires, nonce)):
        return None
    if expires <= (time.time() if now is None else now):
        return None
    return Session(nonce, float(expires), subject)


def same_origin(origin: str | None, referer: str | None, host: str | None) -> bool:
    """Whether a write comes from a page of this gateway: its ``Origin`` (else its ``Referer``) names
    the host the request was sent to. Neither: refused (every browser sends one on a form's POST)."""
    source = origin if origin and origin != "null" else referer
    if not source or not host:
        return False
    return urlsplit(source).netloc.lower() == host.lower()
