"""``python -m benchmarks response-cache``: what the exact response cache costs and saves, in one run.

One fast upstream (:mod:`benchmarks.upstream`) and, in front of it: nothing (``direct``), triage
without a response cache (``pass-through``), triage with the cache in memory and on a real Redis.
Requests at concurrency 1 in rounds whose order rotates (the machine's noise falls on every row
alike), all with ``temperature: 0``:

- ``pass-through``: a new question each time, no cache: the gateway's own overhead;
- ``memory-hit`` / ``redis-hit``: the same question every time, answered from the cache;
- ``memory-miss`` / ``redis-miss``: a new question each time: the lookup and the keeping, on top
  of the pass-through;
- ``memory-bypass``: a sampled question (no temperature) to the gateway with the cache in memory,
  which passes it through: the pass-through again, in the cache's own process (two processes of
  the same code differ by a few tenths of a millisecond on a small machine).

The issue's goal: a hit adds at most 0.3 ms over the pass-through (its p50 minus the
pass-through's), in memory and on Redis. A miss's cost is its p50 minus the pass-through's.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

from benchmarks.load import Sample, Target, sequential
from benchmarks.overhead import machine
from benchmarks.procs import Fleet, Proc, StartFailed, free_port

GOAL_HIT_MS = 0.3


def cpu_kind() -> str:
    """The CPU and the vector extensions its kernels may use, as every figure names it."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    name, flags = info.get("model name", "?"), set(info.get("flags", "").split())
    kinds = [f for f in ("avx2", "avx512_vnni", "amx_tile") if f in flags]
    return f"{name}, {' + '.join(kinds) or 'no AVX2'}"


def _bodies(fixed: bool, cached: bool = True) -> Iterator[bytes]:
    """The same question every time (``fixed``), or a new one; at temperature 0 (``cached``), or
    sampled (the cache passes it through: a bypass)."""
    for i in itertools.count():
        question = "Say hi." if fixed else f"Say hi to number {i}."
        body: dict[str, Any] = {"model": "bench", "messages": [{"role": "user", "content": question}], "max_tokens": 8}
        yield orjson.dumps({**body, "temperature": 0} if cached else body)


def run(rounds: int = 10, requests: int = 2000, warmup: int = 200, out: Path | None = None) -> dict[str, Any]:
    console = Console()
    with tempfile.TemporaryDirectory(prefix="triage-bench-cache-") as tmp:
        result = asyncio.run(_main(rounds, requests, warmup, Path(tmp), console))
    _print(result, console)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        console.print(f"report: {out}")
    return result


async def _redis(fleet: Fleet, workdir: Path) -> Proc | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = fleet.add(Proc("redis", [*argv, "--dir", str(workdir)], port, "", workdir / "redis.log"))
    import redis.asyncio as aioredis

    client = aioredis.Redis(port=port)
    try:
        for _ in range(100):
            try:
                await client.ping()
                return proc
            except (OSError, aioredis.ConnectionError):
                await asyncio.sleep(0.05)
    finally:
        await client.aclose()
    raise StartFailed("redis-server did not answer")


async def _main(rounds: int, requests: int, warmup: int, workdir: Path, console: Console) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": {**machine(), "cpu_kind": cpu_kind()}}
    result["settings"] = {"rounds": rounds, "requests": requests}
    async with aiohttp.ClientSession() as probe:
        with Fleet(workdir) as fleet:
            up = fleet.upstream()
            await up.wait_ready(probe, 20)
            redis = await _redis(fleet, workdir)
            cache = "response_cache: {ttl_s: 3600}\n"
            procs = {
                "direct": up,
                "pass-through": fleet.triage("pass-through", up, "warning"),
                "memory": fleet.triage("memory", up, "warning", extra=cache),
            }
            if redis is not None:
                state = f'state: {{store: redis, url: "redis://127.0.0.1:{redis.port}/0", prefix: bench}}\n'
                procs["redis"] = fleet.triage("redis", up, "warning", extra=cache + state)
            else:
                result["redis"] = "redis-server is not installed: no Redis rows"
            for p in list(procs.values())[1:]:
                await p.wait_ready(probe, 60)
            rows = {
                "direct": (procs["direct"], _bodies(False)),
                "pass-through": (procs["pass-through"], _bodies(False)),
                "memory-bypass": (procs["memory"], _bodies(False, cached=False)),
                **{f"{n}-hit": (procs[n], _bodies(True)) for n in ("memory", "redis") if n in procs},
                **{f"{n}-miss": (procs[n], _bodies(False)) for n in ("memory", "redis") if n in procs},
            }
            targets = []
            for name, (proc, bodies) in rows.items():
                t = Target(name, proc.base + "/v1/chat/completions", bodies=bodies)
                await t.open(4)
                targets.append(t)
            try:
                console.print(f"[bold]warm-up[/]: {warmup} requests per row")
                deadline = time.monotonic() + 3600
                for t in targets:
                    await sequential(t, warmup, deadline)
                per_round = max(1, requests // rounds)
                console.print(f"[bold]latency[/]: {rounds} rounds x {per_round} sequential requests per row")
                lat = {t.name: Sample() for t in targets}
                for r in range(rounds):
                    k = r % len(targets)
                    for t in targets[k:] + targets[:k]:
                        lat[t.name].extend(await sequential(t, per_round, deadline))
            finally:
                for t in targets:
                    await t.close()
    result["latency"] = {name: s.summary() for name, s in lat.items()}
    base = result["latency"]["pass-through"]["p50_ms"]
    for s in result["latency"].values():
        s["over_pass_through_p50_ms"] = round(s["p50_ms"] - base, 3)
    result["goals"] = {
        f"{n}-hit": {
            "goal_ms": GOAL_HIT_MS,
            "measured_ms": result["latency"][f"{n}-hit"]["over_pass_through_p50_ms"],
            "met": result["latency"][f"{n}-hit"]["over_pass_through_p50_ms"] <= GOAL_HIT_MS,
        }
        for n in ("memory", "redis")
        if f"{n}-hit" in result["latency"]
    }
    result["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    return result


def _print(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"response cache, sequential requests [{result['machine']['cpu_kind']}]")
    for col in ("row", "p50 ms", "p99 ms", "p50 over pass-through", "errors"):
        table.add_column(col, justify="right" if col != "row" else "left")
    for name, s in result["latency"].items():
        table.add_row(
            name, f"{s['p50_ms']:.3f}", f"{s['p99_ms']:.3f}", f"{s['over_pass_through_p50_ms']:+.3f}", str(s["errors"])
        )
    console.print(table)
    for name, g in result["goals"].items():
        verdict = "met" if g["met"] else "NOT met"
        console.print(
            f"{name}: {g['measured_ms']:+.3f} ms over the pass-through (goal <= {g['goal_ms']} ms): {verdict}"
        )
