"""Signed tokens instead of keys (issue 55, part 3): a real uvicorn gateway checks JWTs against a
JWKS. No identity provider installs from the registries here, so the tests serve the JWKS
themselves (a real HTTP server under uvicorn) with RSA and EC keys they make with `cryptography`,
and sign the tokens with PyJWT, as a provider would. Good tokens are served through the official
client and held to their team's models and limits; expired ones, another audience or issuer, an
unknown key, `alg: none` and a symmetric signature made with the public key are 401s whose
reason is logged and never sent; a rotated JWKS is picked up without a restart; a provider that
cannot be reached keeps its last keys for a bounded time, then nothing passes."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import jwt
import openai
import pytest
import structlog
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.service.keys.keyring import keyring_for
from tests.conftest import Gateway
from tests.servers import asgi_server

ISSUER, AUDIENCE = "https://idp.test", "triage"
MSG = [{"role": "user", "content": "hi"}]
REFUSED = "Invalid or expired token"


class Provider:
    """A JWKS served over HTTP, its keys made here; what an identity provider publishes."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}  # kid -> private key
        self.published: list[str] = []  # kids in the JWKS
        self.fetches = 0

    def make(self, kid: str, kind: str = "rsa") -> None:
        self.keys[kid] = (
            rsa.generate_private_key(public_exponent=65537, key_size=2048)
            if kind == "rsa"
            else ec.generate_private_key(ec.SECP256R1())
        )

    def jwks(self) -> dict[str, Any]:
        out = []
        for kid in self.published:
            key = self.keys[kid]
            if isinstance(key, rsa.RSAPrivateKey):
                jwk = jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
            else:
                jwk = jwt.algorithms.ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
            out.append({**jwk, "kid": kid, "use": "sig"})
        return {"keys": out}

    def app(self) -> Starlette:
        async def serve(request: Request) -> JSONResponse:
            self.fetches += 1
            return JSONResponse(self.jwks())

        return Starlette(routes=[Route("/jwks", serve)])

    def token(self, kid: str, **claims: Any) -> str:
        now = int(time.time())
        body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "u-1", "email": "ada@lab.test", "team": "research"}
        body |= {"iat": now, "exp": now + 300} | claims
        key = self.keys[kid]
        alg = "RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256"
        return jwt.encode(body, key, algorithm=alg, headers={"kid": kid})


def policy(jwks_url: str, stale_s: float = 3600, refresh_s: float = 300) -> str:
    return f"""version: 1
backends:
  say: {{type: scripted, text: "ok"}}
models:
  m: {{backend: say, prices: {{input_per_mtok: 1000, output_per_mtok: 2000}}}}
  other: {{backend: say}}
teams:
  research: {{models: [m], limits: {{rpm: 4}}}}
access:
  tokens:
    jwks_url: "{jwks_url}"
    issuer: "{ISSUER}"
    audience: "{AUDIENCE}"
    claims: {{user: email, team: team, role: groups}}
    roles: {{triage-operators: operator, triage-viewers: viewer}}
    refresh_s: {refresh_s}
    min_refresh_s: 0
    stale_s: {stale_s}
    timeout_s: 1
"""


@pytest.fixture
def provider() -> Iterator[tuple[Provider, str, ExitStack]]:
    idp = Provider()
    idp.make("k1")
    idp.make("k2", "ec")
    idp.published = ["k1", "k2"]
    stack = ExitStack()
    url = stack.enter_context(asgi_server(idp.app()))
    with stack:
        yield idp, url + "/jwks", stack


def chat(gw: Gateway, token: str, model: str = "m") -> httpx.Response:
    body = {"model": model, "messages": MSG}
    headers = {"authorization": f"Bearer {token}"}
    return httpx.post(gw.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_a_good_token_is_served_and_held_to_its_team(
    gateway: Callable[..., Gateway], provider: tuple[Provider, str, ExitStack]
) -> None:
    idp, url, _ = provider
    gw = gateway(policy(url))
    for kid in ("k1", "k2"):  # RS256 and ES256
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=idp.token(kid), max_retries=0)
        assert client.chat.completions.create(model="m", messages=MSG).choices[0].message.content == "ok"
    token = idp.token("k1")
    refused = chat(gw, token, "other")  # the team's models: m only
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    statuses = [chat(gw, token).status_code for _ in range(3)]  # the team's rpm 4, two used above
    assert statuses == [200, 200, 429], statuses
    limited = chat(gw, idp.token("k2", sub="u-2", email="bo@lab.test"))  # another user of the team shares it
    assert limited.status_code == 429 and "the team 'research'" in limited.json()["error"]["message"]
    # who the token's subject is, kept in the store: a gateway that never saw the token knows it (its batches)
    rt = gw.app.state.triage.holder.current  # type: ignore[attr-defined]
    other = keyring_for(rt.policy, {}, rt.store, admin_key=False)
    subject = hashlib.sha256(f"jwt|{ISSUER}|u-1".encode()).hexdigest()
    found = asyncio.run(other.owner(subject))
    assert found is not None and (found.name, found.team, found.user, found.models) == (
        "jwt:ada@lab.test",
        "research",
        "ada@lab.test",
        ["m"],
    )


def test_bad_tokens_are_a_401_whose_reason_is_logged_never_sent(
    gateway: Callable[..., Gateway], provider: tuple[Provider, str, ExitStack]
) -> None:
    idp, url, _ = provider
    gw = gateway(policy(url))
    idp.make("ghost")  # a key the provider never published
    public_pem = (
        idp.keys["k1"]
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    good_claims = jwt.decode(idp.token("k1"), options={"verify_signature": False})
    payload = b64(json.dumps(good_claims).encode())
    unsigned = f"{b64(json.dumps({'alg': 'none', 'typ': 'JWT'}).encode())}.{payload}."
    confused = f"{b64(json.dumps({'alg': 'HS256', 'kid': 'k1'}).encode())}.{payload}"  # HMAC under the public key
    confused += "." + b64(hmac.new(public_pem, confused.encode(), hashlib.sha256).digest())
    cases = {
        "expired": idp.token("k1", exp=int(time.time()) - 3600, iat=int(time.time()) - 7200),
        "another audience": idp.token("k1", aud="someone-else"),
        "another issuer": idp.token("k1", iss="https://evil.test"),
        "unknown key": idp.token("ghost"),
        "algorithm 'none'": unsigned,
        "algorithm 'HS256'": confused,
        "no 'team' claim": idp.token("k1", team=None),
        "malformed": "eyJhbGci.eyJ.c2ln",
    }
    with structlog.testing.capture_logs() as logs:
        for reason, token in cases.items():
            r = chat(gw, token)
            assert r.status_code == 401, (reason, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["message"] == REFUSED, (reason, err)
            assert token not in r.text
        openai_client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=cases["expired"], max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            openai_client.chat.completions.create(model="m", messages=MSG)
        messages = httpx.post(  # Anthropic's surface: its own error shape, the same silence
            gw.base_url + "/v1/messages",
            json={"model": "m", "max_tokens": 8, "messages": MSG},
            headers={"x-api-key": cases["another audience"]},
            timeout=30,
        )
        assert messages.status_code == 401 and messages.json()["type"] == "error", messages.text
        assert messages.json()["error"]["type"] == "authentication_error"
        assert messages.json()["error"]["message"] == REFUSED
    refused = [e for e in logs if e["event"] == "token_refused"]
    said = " | ".join(e["reason"] for e in refused)
    for reason in cases:
        assert reason.replace("'", "") in said.replace("'", ""), (reason, said)
    assert not any(token in json.dumps(e, default=str) for e in logs for token in cases.values())


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def test_a_rotated_jwks_is_picked_up_without_a_restart(
    gateway: Callable[..., Gateway], provider: tuple[Provider, str, ExitStack]
) -> None:
    idp, url, _ = provider
    gw = gateway(policy(url, refresh_s=1))
    assert chat(gw, idp.token("k1")).status_code == 200
    idp.make("k3")
    idp.published = ["k3"]  # the provider rotates: k1 and k2 retired, k3 signs from now on
    assert chat(gw, idp.token("k3")).status_code == 200  # an unknown key id fetches the set again at once
    old = idp.token("k1")
    assert chat(gw, old).status_code == 401  # the set fetched for k3 no longer holds k1
    assert idp.fetches >= 2


def test_an_unreachable_provider_keeps_its_last_keys_for_a_bounded_time(
    gateway: Callable[..., Gateway], provider: tuple[Provider, str, ExitStack]
) -> None:
    idp, url, stack = provider
    gw = gateway(policy(url, refresh_s=1, stale_s=2))
    token = idp.token("k1")
    assert chat(gw, token).status_code == 200
    fetched_at = time.monotonic()
    stack.close()  # the provider goes away
    with structlog.testing.capture_logs() as logs:
        time.sleep(1.2)  # the keys are due for a refresh, which fails: they still serve
        assert chat(gw, token).status_code == 200
        assert any(e["event"] == "jwks_fetch_failed" for e in logs)
        while time.monotonic() - fetched_at < 3.3:  # refresh_s + stale_s, and a little
            time.sleep(0.2)
        r = chat(gw, token)
    assert r.status_code == 503 and r.json()["error"]["code"] == "identity_provider_unavailable", r.text
    assert token not in r.text


def test_a_tokens_role_opens_the_admin_api_as_the_table_says(
    gateway: Callable[..., Gateway], provider: tuple[Provider, str, ExitStack]
) -> None:
    idp, url, _ = provider
    gw = gateway(policy(url))

    def admin(token: str, method: str, path: str, body: object = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"}
        return httpx.request(method, gw.base_url + path, json=body, headers=headers, timeout=30)

    operator = idp.token("k1", groups=["staff", "triage-operators"])
    me = admin(operator, "GET", "/admin/whoami").json()
    assert me["role"] == "operator" and me["name"] == "jwt:ada@lab.test" and me["via"] == "token"
    assert admin(operator, "POST", "/admin/teams", {"name": "lab", "limits": {"rpm": 10}}).status_code == 201
    assert admin(operator, "POST", "/admin/reload").status_code == 403  # the policy is the admin's
    viewer = idp.token("k2", sub="u-9", email="vi@lab.test", groups="triage-viewers")
    assert admin(viewer, "GET", "/admin/teams").status_code == 200
    assert admin(viewer, "POST", "/admin/teams", {"name": "x"}).status_code == 403
    nobody = idp.token("k1", groups=["staff"])
    assert chat(gw, nobody).status_code == 200  # a user of the team, with no role
    assert admin(nobody, "GET", "/admin/keys").status_code == 401
    audit = admin(operator, "GET", "/admin/audit").json()["data"]  # newest first; a 401 is only logged
    assert [(e["who"], e["role"], e["action"], e["outcome"], e["via"]) for e in audit] == [
        ("jwt:vi@lab.test", "viewer", "teams.write", "refused", "token"),
        ("jwt:vi@lab.test", "viewer", "teams.read", "allowed", "token"),
        ("jwt:ada@lab.test", "operator", "policy.reload", "refused", "token"),
        ("jwt:ada@lab.test", "operator", "teams.write", "allowed", "token"),
    ]
    assert audit[3]["target"] == "team:lab" and audit[3]["client"] == "127.0.0.1" and audit[3]["at"] <= time.time()
