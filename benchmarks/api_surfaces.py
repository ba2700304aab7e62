"""What `/v1/responses` and `/v1/messages` add on top of chat completions, in one run.

The tiny upstream of `python -m benchmarks overhead` (benchmarks.upstream) and triage in front of it
(logging at warning), both their own processes. Sequential requests (concurrency 1), in rounds
whose endpoint order rotates so the machine's noise falls on all alike: the upstream's own chat
(direct), triage's chat completions, Responses and Messages, each the same one-turn prompt and
`max_tokens` 8. Added latency = an endpoint's p50 minus direct's; the goal (issue: within 1.2x of
chat's) is the Responses and Messages added p50 over chat's.

    .venv/bin/python benchmarks/api_surfaces.py [--rounds 10 --per-round 200] [--out out/api-surfaces.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from benchmarks.procs import Fleet

PROMPT = "Say hi."
BODIES = {
    "chat": (
        "/v1/chat/completions",
        {"model": "bench", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8},
    ),
    "responses": ("/v1/responses", {"model": "bench", "input": PROMPT, "max_output_tokens": 8}),
    "messages": (
        "/v1/messages",
        {"model": "bench", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8},
    ),
}
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer bench", "x-api-key": "bench"}


async def _run(session: aiohttp.ClientSession, url: str, body: bytes, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.post(url, data=body, headers=HEADERS) as r:
            raw = await r.read()
        if r.status != 200:
            raise SystemExit(f"{url}: HTTP {r.status}: {raw[:300]!r}")
        out.append(time.perf_counter() - t0)
    return out


async def main(rounds: int, per_round: int, warmup: int) -> dict:
    with Fleet(Path(tempfile.mkdtemp())) as fleet:
        up = fleet.upstream()
        async with aiohttp.ClientSession() as probe:
            await up.wait_ready(probe, 20)
            tri = fleet.triage("triage", up, "warning")
            await tri.wait_ready(probe, 60)
        targets = {"direct": (up.base + "/v1/chat/completions", BODIES["chat"][1])}
        targets |= {name: (tri.base + path, body) for name, (path, body) in BODIES.items()}
        encoded = {name: (url, orjson.dumps(body)) for name, (url, body) in targets.items()}
        times: dict[str, list[float]] = {name: [] for name in encoded}
        connector = aiohttp.TCPConnector(limit=8, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector) as session:
            for url, body in encoded.values():
                await _run(session, url, body, warmup)
            names = list(encoded)
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    times[name] += await _run(session, *encoded[name], per_round)
    p50 = {name: statistics.median(v) * 1000 for name, v in times.items()}
    added = {name: p50[name] - p50["direct"] for name in p50 if name != "direct"}
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "requests_per_endpoint": rounds * per_round,
        "p50_ms": {k: round(v, 4) for k, v in p50.items()},
        "added_p50_ms": {k: round(v, 4) for k, v in added.items()},
        "ratio_to_chat": {k: round(added[k] / added["chat"], 3) for k in ("responses", "messages")},
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = asyncio.run(main(args.rounds, args.per_round, args.warmup))
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
