"""What tenancy costs a request (docs/tenancy.md): a signed token's check (RS256 and ES256, the JWKS
served over HTTP on loopback and fetched once), and a key's limits checked alone against a key's and
its team's in one step, on the memory store and on a real Redis (started here when redis-server is
on PATH). ``python -m benchmarks.tenancy_bench [--n 2000]``; prints one JSON report."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gateway.service.keys.tokens import Tokens
from gateway.state.stores import Check, MemoryStore, RedisStore
from policies.schema_access import TokenSpec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_jwks(doc: dict[str, Any]) -> tuple[HTTPServer, str]:
    body = json.dumps(doc).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return None

    server = HTTPServer(("127.0.0.1", _free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/jwks"


async def _tokens(n: int) -> dict[str, float]:
    keys = {
        "r": rsa.generate_private_key(public_exponent=65537, key_size=2048),
        "e": ec.generate_private_key(ec.SECP256R1()),
    }
    jwks = [
        {**jwt.algorithms.RSAAlgorithm.to_jwk(keys["r"].public_key(), as_dict=True), "kid": "r"},
        {**jwt.algorithms.ECAlgorithm.to_jwk(keys["e"].public_key(), as_dict=True), "kid": "e"},
    ]
    server, url = _serve_jwks({"keys": jwks})
    spec = TokenSpec(jwks_url=url, issuer="https://idp", audience="triage")
    tokens = Tokens(spec)
    out = {}
    now = int(time.time())
    claims = {"iss": "https://idp", "aud": "triage", "sub": "u", "team": "t", "exp": now + 3600}
    for kid, alg in (("r", "RS256"), ("e", "ES256")):
        made = [
            jwt.encode({**claims, "sub": f"u{i}"}, keys[kid], algorithm=alg, headers={"kid": kid}) for i in range(n)
        ]
        await tokens.verify(made[0])  # the JWKS fetched once
        t0 = time.perf_counter()
        for token in made:  # each token seen for the first time: its signature and claims checked
            await tokens.verify(token)
        out[f"verify_{alg}_first_us"] = round((time.perf_counter() - t0) / n * 1e6, 1)
        t0 = time.perf_counter()
        for token in made:  # the same tokens again: remembered while the keys are fresh
            await tokens.verify(token)
        out[f"verify_{alg}_again_us"] = round((time.perf_counter() - t0) / n * 1e6, 1)
    server.shutdown()
    return out


async def _checks(store: MemoryStore | RedisStore, name: str, n: int) -> dict[str, float]:
    day = ("2026-12-07",)
    alone = Check(f"{name}-k", day, budget_day=1e9, rpm=10**9)
    both = (alone, Check(f"team:{name}-t", day, budget_day=1e9, rpm=10**9))
    out = {}
    for label, run in (("key_alone", lambda: store.check(alone)), ("key_and_team", lambda: store.check_all(both))):
        await run()
        t0 = time.perf_counter()
        for _ in range(n):
            await run()
        out[f"{name}_{label}_us"] = round((time.perf_counter() - t0) / n * 1e6, 1)
    return out


async def _main(n: int) -> dict[str, Any]:
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine()}
    report |= await _tokens(n)
    report |= await _checks(MemoryStore(), "memory", n)
    binary = shutil.which("redis-server")
    if binary is not None:
        port = _free_port()
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
        )
        try:
            store = RedisStore(f"redis://127.0.0.1:{port}/0", "bench", 2.0)
            for _ in range(100):
                try:
                    await store.ping()
                    break
                except Exception:  # not up yet
                    await asyncio.sleep(0.05)
            report |= await _checks(store, "redis", n)
            await store.close()
        finally:
            proc.terminate()
            proc.wait(10)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000)
    print(json.dumps(asyncio.run(_main(parser.parse_args().n)), indent=2))


if __name__ == "__main__":
    main()
