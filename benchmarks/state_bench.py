"""``python -m benchmarks state``: what shared state costs, in one run (issue 18's goals).

One fast upstream (:mod:`benchmarks.upstream`), one real ``redis-server`` on a loopback port, and
two triage processes on the same policy but for ``state``: ``memory`` (the embedded default) and
``redis``. Every request carries a key with an rpm limit and a day budget, so each one is checked
and counted in the store. In interleaved rounds at concurrency 1 (the order rotates, so machine
noise falls on every row alike), p50 latency of:

- ``direct``: the upstream alone;
- ``chat``: a chat completion through triage (its overhead: minus ``direct``);
- ``decide-hit``: a typed decision answered from the decision cache;
- ``decide-miss``: a new question each time (the cache is asked, the tier answers, the cache is
  written); ``decide-off``: the same cascade without the cache (memory only).

Goals read from it: a hit adds at most 0.5 ms to the gateway's own overhead (hit p50 minus chat
overhead; a hit asks no upstream); with Redis the pass-through overhead is within 1.5x of memory's.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import itertools
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

from benchmarks import report
from benchmarks.load import Sample, percentile
from benchmarks.procs import HOST, Fleet, Proc, StartFailed, free_port

KEY = "sk-bench-state"
_CHAT = orjson.dumps({"model": "bench", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})


def policy(api_base: str, state: str, cache: bool = True) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""version: 1
backends:
  upstream:
    type: openai
    replicas:
      - {{api_base: "{api_base}"}}
    health: {{enabled: false}}
  local: {{type: scripted, text: "A"}}
models:
  bench: {{backend: upstream, prices: {{input_per_mtok: 1, output_per_mtok: 2}}}}
  local: {{backend: local}}
cascade:
  {"cache_ttl_s: 3600" if cache else "on_exhausted: error"}
  tiers:
    - {{name: only, type: model, model: local, logprobs: false}}
keys:
  - {{name: bench, sha256: "{digest}", limits: {{rpm: 100000000, budget_per_day: 100000000}}}}
limits: {{max_concurrency: 4096}}
logging: {{level: warning}}
state: {state}
"""


@dataclass
class Row:
    name: str
    url: str
    body: Any  # bytes, or a callable giving each request's bytes
    sample: Sample = field(default_factory=Sample)

    def payload(self) -> bytes:
        return self.body() if callable(self.body) else self.body


def _decide_body(unique: bool) -> Any:
    n = itertools.count()
    fixed = orjson.dumps({"question": "Which one?", "type": "choice", "options": ["red", "green", "blue"]})
    if not unique:
        return fixed
    return lambda: orjson.dumps({"question": f"Which one? #{next(n)}", "type": "choice", "options": ["r", "g", "b"]})


async def _once(session: aiohttp.ClientSession, row: Row) -> float:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    t0 = time.perf_counter()
    async with session.post(row.url, data=row.payload(), headers=headers) as r:
        raw = await r.read()
    took = time.perf_counter() - t0
    if r.status != 200:
        raise RuntimeError(f"{row.name}: HTTP {r.status}: {raw[:300]!r}")
    return took


def _redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise StartFailed("redis-server is not installed (apt-get install redis-server; make test installs it)")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no", "--dir", str(workdir)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"redis://{HOST}:{port}/0"


def _triage(fleet: Fleet, name: str, text: str) -> Proc:
    path = fleet.workdir / f"{name}.yaml"
    path.write_text(text)
    port = free_port()
    argv = ["-m", "gateway.cli", "serve", "--policy", str(path), "--host", HOST, "--port", str(port), "--no-watch"]
    return fleet.add(Proc(name, [sys.executable, *argv], port, "/health", fleet.workdir / f"{name}.log"))


async def _main(rounds: int, per_round: int, warmup: int, workdir: Path) -> dict[str, Any]:
    redis_proc, redis_url = _redis(workdir)
    try:
        with Fleet(workdir) as fleet:
            up = fleet.upstream()
            api = up.base + "/v1"
            mem = _triage(fleet, "memory", policy(api, "{store: memory}"))
            red = _triage(fleet, "redis", policy(api, f'{{store: redis, url: "{redis_url}", prefix: "bench"}}'))
            off = _triage(fleet, "memory-nocache", policy(api, "{store: memory}", cache=False))
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8)) as session:
                for p in (up, mem, red, off):
                    await p.wait_ready(session, 60)
                rows = [
                    Row("direct", f"{up.base}/v1/chat/completions", _CHAT),
                    Row("chat memory", f"{mem.base}/v1/chat/completions", _CHAT),
                    Row("chat redis", f"{red.base}/v1/chat/completions", _CHAT),
                    Row("decide-hit memory", f"{mem.base}/v1/decide", _decide_body(False)),
                    Row("decide-hit redis", f"{red.base}/v1/decide", _decide_body(False)),
                    Row("decide-miss memory", f"{mem.base}/v1/decide", _decide_body(True)),
                    Row("decide-miss redis", f"{red.base}/v1/decide", _decide_body(True)),
                    Row("decide-off memory", f"{off.base}/v1/decide", _decide_body(False)),
                ]
                for row in rows:
                    for _ in range(warmup):
                        await _once(session, row)
                for r in range(rounds):
                    for row in rows[r % len(rows) :] + rows[: r % len(rows)]:
                        t0 = time.perf_counter()
                        for _ in range(per_round):
                            row.sample.latencies.append(await _once(session, row))
                        row.sample.wall_s += time.perf_counter() - t0
    finally:
        redis_proc.terminate()
        redis_proc.wait(10)
    return _result(rows, rounds, per_round)


def _p50(rows: list[Row], name: str) -> float:
    row = next(r for r in rows if r.name == name)
    return percentile(sorted(row.sample.latencies), 0.5) * 1000


def _result(rows: list[Row], rounds: int, per_round: int) -> dict[str, Any]:
    direct = _p50(rows, "direct")
    table = {r.name: r.sample.summary() for r in rows}
    over = {s: _p50(rows, f"chat {s}") - direct for s in ("memory", "redis")}
    hit_extra = {s: _p50(rows, f"decide-hit {s}") - over[s] for s in ("memory", "redis")}
    goals = [
        {
            "goal": f"a cache hit adds <= 0.5 ms to the gateway's own overhead ({s}: hit p50 - chat overhead p50)",
            "value": hit_extra[s],
            "unit": "ms",
            "pass": hit_extra[s] <= 0.5,
        }
        for s in ("memory", "redis")
    ]
    ratio = over["redis"] / over["memory"] if over["memory"] > 0 else float("nan")
    goals.append(
        {
            "goal": "pass-through overhead with Redis <= 1.5x the embedded default's (added p50)",
            "value": ratio,
            "unit": "x",
            "pass": ratio <= 1.5,
        }
    )
    return {
        "benchmark": "state",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "rounds": rounds,
        "per_round": per_round,
        "rows": table,
        "overhead_p50_ms": {k: round(v, 3) for k, v in over.items()},
        "goals": goals,
    }


def run(rounds: int, per_round: int, warmup: int, out: Path) -> dict[str, Any]:
    console = Console()
    with tempfile.TemporaryDirectory(prefix="triage-bench-state-") as tmp:
        result = asyncio.run(_main(rounds, per_round, warmup, Path(tmp)))
    t = Table("row", "n", "p50 ms", "p90 ms", "p99 ms", title="Latency at concurrency 1 (interleaved rounds)")
    for name, s in result["rows"].items():
        t.add_row(name, str(s["n"]), f"{s['p50_ms']:.3f}", f"{s['p90_ms']:.3f}", f"{s['p99_ms']:.3f}")
    console.print(t)
    console.print(report.goals_table(result["goals"]))
    report.save(console, out, result)
    return result
