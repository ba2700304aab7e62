"""``python -m benchmarks response-cache``: what the exact response cache costs and saves, in one run.

One fast upstream (:mod:`benchmarks.upstream`) and, in front of it: nothing (``direct``), triage
without a response cache (``pass-through``), triage with the cache in memory and on a real Redis.
Requests at concurrency 1 in rounds whose order rotates (the machine's noise falls on every row
alike), all with ``temperature: 0``:

- ``pass-through``: a new question each time, no cache: the gateway's own overhead;
- ``memory-hit`` / ``redis-hit``: the same question every time, answered from the cache;
- ``memory-miss`` / ``redis-miss``: a new question each time: the lookup and the keeping, on top
  of the pass-through;
- ``semantic-hit``: similar questions to a gateway whose semantic rule accepts them (a hit after
  the first: the encoder's pass, the lookup, the kept answer);
- ``semantic-miss``: the same to a gateway whose rule accepts nothing: the encoder's pass and the
  lookup on top of a miss (and, off the path but on the same cores, the answer's embedding).
  The two semantic gateways log each request (level info) with the lookup's time and its encoder
  pass's: the lookup net of the encoder's pass is read from those events (goal: at most 1 ms).
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
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

from benchmarks.load import Target, interleaved
from benchmarks.meters import cpu_kind
from benchmarks.overhead import machine
from benchmarks.procs import Fleet, start_redis

GOAL_HIT_MS = 0.3
GOAL_SEMANTIC_MS = 1.0
NEVER = "{kind: global, similarity: 2.0}"  # a rule that accepts nothing: every lookup is a miss


def _lookups(log: Path, result: str) -> dict[str, Any]:
    """The semantic lookups a gateway timed (its request events): p50 of the whole lookup, of its
    encoder pass, and of the rest (the exact lookup, the index, the rule, the kept answer's read)."""
    whole, embed = [], []
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        cache = event.get("cache") if isinstance(event, dict) else None
        if isinstance(cache, dict) and cache.get("result") == result and cache.get("embed_ms") is not None:
            whole.append(cache["lookup_ms"])
            embed.append(cache["embed_ms"])
    net = [w - e for w, e in zip(whole, embed, strict=True)]
    med = statistics.median
    return {
        "n": len(whole),
        "lookup_p50_ms": round(med(whole), 3) if whole else None,
        "embed_p50_ms": round(med(embed), 3) if embed else None,
        "net_p50_ms": round(med(net), 3) if net else None,
        "net_p99_ms": round(sorted(net)[int(0.99 * (len(net) - 1))], 3) if net else None,
    }


def _bodies(fixed: bool, cached: bool = True) -> Iterator[bytes]:
    """The same question every time (``fixed``), or a new one; at temperature 0 (``cached``), or
    sampled (the cache passes it through: a bypass)."""
    for i in itertools.count():
        question = "Say hi." if fixed else f"Say hi to number {i}."
        body: dict[str, Any] = {"model": "bench", "messages": [{"role": "user", "content": question}], "max_tokens": 8}
        yield orjson.dumps({**body, "temperature": 0} if cached else body)


def run(
    rounds: int = 10, requests: int = 2000, warmup: int = 200, semantic: bool = True, out: Path | None = None
) -> dict[str, Any]:
    console = Console()
    with tempfile.TemporaryDirectory(prefix="triage-bench-cache-") as tmp:
        result = asyncio.run(_main(rounds, requests, warmup, semantic, Path(tmp), console))
    _print(result, console)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        console.print(f"report: {out}")
    return result


async def _main(
    rounds: int, requests: int, warmup: int, semantic: bool, workdir: Path, console: Console
) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": {**machine(), "cpu_kind": cpu_kind()}}
    result["settings"] = {"rounds": rounds, "requests": requests}
    async with aiohttp.ClientSession() as probe:
        with Fleet(workdir) as fleet:
            up = fleet.upstream()
            await up.wait_ready(probe, 20)
            redis = await start_redis(fleet, workdir)
            cache = "response_cache: {ttl_s: 3600}\n"
            procs = {
                "direct": up,
                "pass-through": fleet.triage("pass-through", up, "warning"),
                "memory": fleet.triage("memory", up, "warning", extra=cache),
            }
            if semantic:
                heads = Path(__file__).resolve().parents[1] / "policies" / "examples" / "heads"
                clf = (
                    f"classifier:\n  artifacts: {heads}\n  heads: [question_type, category, reasoning, injection]\n"
                    "  encoder: {precision: int8, threads: 1, max_tokens: 256, batch_max_wait_ms: 0}\n"
                )
                for name, rule in (("semantic", "{kind: global, similarity: 0.8}"), ("semantic-never", NEVER)):
                    sem = f"response_cache:\n  semantic: {{models: [bench], rule: {rule}, audit_share: 0}}\n"
                    # info: each request's event says its lookup's time and its encoder pass's (read below)
                    procs[name] = fleet.triage(name, up, "info", extra=clf + sem)
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
            if semantic:  # similar questions (a hit after the first), and ones the rule never accepts
                rows["semantic-hit"] = (procs["semantic"], _bodies(False))
                rows["semantic-miss"] = (procs["semantic-never"], _bodies(False))
            targets = []
            for name, (proc, bodies) in rows.items():
                t = Target(name, proc.base + "/v1/chat/completions", bodies=bodies)
                await t.open(4)
                targets.append(t)
            try:
                console.print(f"[bold]latency[/]: {warmup} warm-up, {rounds} rounds of {requests} requests a row")
                lat = await interleaved(targets, rounds, requests, warmup)
            finally:
                for t in targets:
                    await t.close()
    result["latency"] = {name: s.summary() for name, s in lat.items()}
    if semantic:  # the gateways have stopped: their logs are whole
        result["semantic_lookup"] = {
            "hit": _lookups(workdir / "semantic.log", "hit"),
            "miss": _lookups(workdir / "semantic-never.log", "miss"),
        }
        result["semantic_lookup_ms"] = max(r["net_p50_ms"] or 0.0 for r in result["semantic_lookup"].values())
    base = result["latency"]["pass-through"]["p50_ms"]
    for s in result["latency"].values():
        s["over_pass_through_p50_ms"] = round(s["p50_ms"] - base, 3)
    goals_semantic = (
        {
            "semantic-lookup": {
                "what": "a semantic lookup's p50, net of its encoder pass (the worse of hit and miss)",
                "goal_ms": GOAL_SEMANTIC_MS,
                "measured_ms": result["semantic_lookup_ms"],
                "met": result["semantic_lookup_ms"] <= GOAL_SEMANTIC_MS,
            }
        }
        if semantic
        else {}
    )
    result["goals"] = goals_semantic | {
        f"{n}-hit": {
            "what": "a hit's p50 over the pass-through's",
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
    for name, r in result.get("semantic_lookup", {}).items():
        console.print(
            f"semantic lookup, {name} ({r['n']} timed by the gateway): {r['lookup_p50_ms']} ms p50, of which the "
            f"encoder's pass {r['embed_p50_ms']} ms; the rest {r['net_p50_ms']} ms p50, {r['net_p99_ms']} ms p99"
        )
    for name, g in result["goals"].items():
        verdict = "met" if g["met"] else "NOT met"
        console.print(f"{name}: {g['what']}: {g['measured_ms']:+.3f} ms (goal <= {g['goal_ms']} ms): {verdict}")
