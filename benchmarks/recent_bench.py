"""``python -m benchmarks recent``: what the fleet's ring of recent requests adds to a request
(``gateway/state/recent_redis.py``: each answered request's summary pushed to Redis off the
request's path, in batches), against the same gateway without it, in one run.

One fast upstream (:mod:`benchmarks.upstream`), one real ``redis-server``, and two ``triage serve``
processes on the same policy (``state.store: redis``, the console on) but for ``console.shared``:
``off`` (the process's own ring only) and ``on`` (that, and the fleet's ring). Requests alternate
between the two, one at a time, so both see the same machine at the same moment. Reported: p50 and
p99 latency of each, the gateway process's CPU per request (the background writes included), and
the ratios on/off; and how many summaries the ring holds at the end (every request's, up to its
bound).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import meters
from benchmarks.procs import Fleet, Proc, StartFailed, free_port, start_redis

POLICY = """version: 1
backends:
  up: {{type: openai, replicas: [{{api_base: "{base}/v1"}}], health: {{enabled: false}}}}
models:
  bench: {{backend: up, upstream: bench, prices: {{input_per_mtok: 1, output_per_mtok: 2}}}}
state: {{store: redis, url: "redis://127.0.0.1:{redis}/0", prefix: {prefix}}}
console: {{shared: {shared}, recent: {recent}}}
logging: {{level: warning}}
"""
ROWS = ("off", "on")  # off first: the baseline


def run(requests: int = 3000, warmup: int = 300, recent: int = 2000) -> dict[str, Any]:
    return asyncio.run(_main(requests, warmup, recent))


async def _main(requests: int, warmup: int, recent: int) -> dict[str, Any]:
    import redis.asyncio as aioredis

    with tempfile.TemporaryDirectory(prefix="triage-recent-") as tmp, Fleet(Path(tmp)) as fleet:
        work = Path(tmp)
        async with aiohttp.ClientSession() as http:
            up = fleet.upstream()
            await up.wait_ready(http, 20)
            store = await start_redis(fleet, work)
            if store is None:
                raise StartFailed("redis-server is not installed (apt-get install redis-server)")
            gws: dict[str, Proc] = {}
            for row in ROWS:
                text = POLICY.format(
                    base=up.base,
                    redis=store.port,
                    prefix=f"bench-{row}",
                    shared=str(row == "on").lower(),
                    recent=recent,
                )
                (work / f"{row}.yaml").write_text(text)
                port = free_port()
                argv = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(work / f"{row}.yaml")]
                gws[row] = fleet.add(
                    Proc(row, [*argv, "--port", str(port), "--no-watch"], port, "/health", work / f"{row}.log")
                )
                await gws[row].wait_ready(http, 60)
            times: dict[str, list[float]] = {row: [] for row in ROWS}
            cpu: dict[str, float] = {}
            body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
            for i in range(warmup + requests):
                if i == warmup:
                    cpu = {row: meters.group_cpu_s(gws[row].pid) for row in ROWS}
                for row in ROWS if i % 2 else reversed(ROWS):  # who goes first alternates
                    t0 = time.perf_counter()
                    async with http.post(gws[row].base + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        assert r.status == 200, r.status
                    if i >= warmup:
                        times[row].append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(0.5)  # the last batch written
            cpu = {row: meters.group_cpu_s(gws[row].pid) - cpu[row] for row in ROWS}
            client = aioredis.Redis(port=store.port)
            try:
                kept = {row: await client.llen(f"bench-{row}:recent") for row in ROWS}
            finally:
                await client.aclose()
    out: dict[str, Any] = {"machine": meters.cpu_kind(), "requests": requests, "ring_bound": recent}
    for row in ROWS:
        t = sorted(times[row])
        out[row] = {
            "p50_ms": round(statistics.median(t), 4),
            "p99_ms": round(t[int(len(t) * 0.99)], 4),
            "cpu_ms_per_request": round(cpu[row] / requests * 1000, 4),
            "ring_entries": kept[row],
        }
    off, on = out["off"], out["on"]
    out["added_p50_ms"] = round(on["p50_ms"] - off["p50_ms"], 4)
    out["ratio_p50"] = round(on["p50_ms"] / off["p50_ms"], 4)
    out["added_cpu_ms_per_request"] = round(on["cpu_ms_per_request"] - off["cpu_ms_per_request"], 4)
    out["ratio_cpu"] = round(on["cpu_ms_per_request"] / off["cpu_ms_per_request"], 4)
    return out
