"""``python -m benchmarks quality``: what the quality watch costs a request, in one run.

Four gateways on the same cascade (two model tiers on scripted engines: the first keeps every
answer, so every request is one a shadow check may take), asked typed questions one after
another in rounds whose order rotates (the machine's noise falls on every row alike):

- ``cascade``: no ``quality`` section: the baseline;
- ``records``: a ``quality`` section, no shadow: each decision leaves a record (buffered, written
  to SQLite every 0.5 s, off the path);
- ``shadow-5``: records and shadow checks of 5% of the decisions (the issue's example);
- ``shadow-100``: every decision checked against the top (the worst case: a background call per
  request on the same cores).

The issue's goal: a shadow check never delays the answer, p50 with and without shadowing within
0.1 ms (``shadow-5`` against ``cascade``). The top engine answers at once, so the checks compete
for the CPU, not for time.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
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
from benchmarks.procs import HOST, Fleet, Proc, free_port

GOAL_MS = 0.1

POLICY = """version: 1
backends:
  cheap_b: {type: scripted, text: "A"}
  top_b: {type: scripted, text: "A", replies: [{contains: "[hard]", text: "B"}]}
models:
  cheap: {backend: cheap_b, prices: {input_per_mtok: 1, output_per_mtok: 1}}
  top: {backend: top_b, prices: {input_per_mtok: 100, output_per_mtok: 100}}
cascade:
  tiers:
    - {name: small, type: model, model: cheap, logprobs: false, assumed_confidence: 0.9, thresholds: {choice: 0.5}}
    - {name: big, type: model, model: top, logprobs: false}
SHADOW
limits: {max_concurrency: 4096}
logging: {level: warning, format: json}
"""

ROWS = {
    "cascade": "",
    "records": "quality: {path: QUALITY}\n",
    "shadow-5": "  shadow: {sample: 0.05, budget_per_day: 1000000, concurrency: 64}\nquality: {path: QUALITY}\n",
    "shadow-100": "  shadow: {sample: 1.0, budget_per_day: 1000000, concurrency: 64}\nquality: {path: QUALITY}\n",
}


def _bodies() -> Iterator[bytes]:
    for i in itertools.count():
        q = f"Question {i}: which one?" + (" [hard]" if i % 10 == 0 else "")
        yield orjson.dumps({"question": q, "type": "choice", "options": ["first", "second"]})


def _gateway(fleet: Fleet, name: str, extra: str, workdir: Path) -> Proc:
    port = free_port()
    policy = workdir / f"{name}.yaml"
    text = POLICY.replace("SHADOW\n", extra.replace("QUALITY", str(workdir / f"{name}.sqlite3")))
    policy.write_text(text)
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(policy), "--host", HOST]
    argv += ["--port", str(port), "--no-watch"]
    return fleet.add(Proc(name, argv, port, "/v1/models", workdir / f"{name}.log"))


async def _main(rounds: int, requests: int, warmup: int, workdir: Path, console: Console) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": {**machine(), "cpu_kind": cpu_kind()}}
    result["settings"] = {"rounds": rounds, "requests": requests, "warmup": warmup}
    async with aiohttp.ClientSession() as probe:
        with Fleet(workdir) as fleet:
            procs = {name: _gateway(fleet, name, extra, workdir) for name, extra in ROWS.items()}
            for p in procs.values():
                await p.wait_ready(probe, 60)
            targets = []
            for name, proc in procs.items():
                t = Target(name, proc.base + "/v1/decide", bodies=_bodies())
                await t.open(4)
                targets.append(t)
            try:
                console.print(f"[bold]latency[/]: {warmup} warm-up, {rounds} rounds of {requests} decisions a row")
                lat = await interleaved(targets, rounds, requests, warmup)
            finally:
                for t in targets:
                    await t.close()
    result["latency"] = {name: s.summary() for name, s in lat.items()}
    base = result["latency"]["cascade"]["p50_ms"]
    for s in result["latency"].values():
        s["over_cascade_p50_ms"] = round(s["p50_ms"] - base, 3)
    measured = result["latency"]["shadow-5"]["over_cascade_p50_ms"]
    result["goals"] = {
        "shadow-5": {
            "what": "p50 with 5% shadow checks over the same cascade without the watch",
            "goal_ms": GOAL_MS,
            "measured_ms": measured,
            "met": abs(measured) <= GOAL_MS,
        }
    }
    return result


def _print(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"quality watch, sequential decisions [{result['machine']['cpu_kind']}]")
    for col in ("row", "n", "errors", "p50 ms", "p99 ms", "p50 over cascade"):
        table.add_column(col, justify="right" if col != "row" else "left")
    for name, s in result["latency"].items():
        table.add_row(
            name,
            str(s["n"]),
            str(s["errors"]),
            f"{s['p50_ms']:.3f}",
            f"{s['p99_ms']:.3f}",
            f"{s['over_cascade_p50_ms']:+.3f}",
        )
    console.print(table)
    for name, g in result["goals"].items():
        verdict = "[green]met[/]" if g["met"] else "[red]not met[/]"
        console.print(f"{name}: {g['what']}: {g['measured_ms']:+.3f} ms (goal within {g['goal_ms']} ms): {verdict}")


def run(rounds: int = 10, requests: int = 2000, warmup: int = 200, out: Path | None = None) -> dict[str, Any]:
    console = Console()
    with tempfile.TemporaryDirectory(prefix="triage-bench-quality-") as tmp:
        result = asyncio.run(_main(rounds, requests, warmup, Path(tmp), console))
    _print(result, console)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        console.print(f"report: {out}")
    return result
