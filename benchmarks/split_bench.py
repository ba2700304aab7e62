"""``python -m benchmarks split``: what a weighted split, a guarded split and a mirror add to a
request, against the same model asked by name, in one run (issue 54's goal: at most 0.05 ms p50).

One fast upstream (:mod:`benchmarks.upstream`) and one ``triage serve`` in front of it, whose
policy has models on that upstream, a ``split`` virtual model over two of them (90/10, sticky per
user), the same split with a guard (every request recorded in the quality store), and a model
mirrored to another at 5% (and one at 100%: every request copied in the background, on the same
two cores). Requests go round the rows, one at a time, each round starting one row later (a
mirror's background call lands on whichever row comes next), so every row sees the same machine
at the same moment; reported: p50 and p99 of each, the difference of its p50 from the model by name's,
and their ratio.
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

from benchmarks.procs import Fleet, Proc, free_port

POLICY = """version: 1
backends:
  up: {{type: openai, replicas: [{{api_base: "{base}/v1"}}], health: {{enabled: false}}}}
models:
  current: {{backend: up, upstream: bench}}
  candidate: {{backend: up, upstream: bench}}
  mirrored: {{backend: up, upstream: bench}}
  copied: {{backend: up, upstream: bench}}
virtual_models:
  chat: {{type: split, targets: {{current: 90, candidate: 10}}, sticky: user}}
  guarded: {{type: split, targets: {{current: 90, candidate: 10}}, sticky: user, guard: {{min_requests: 50}}}}
mirrors:
  mirrored: {{to: candidate, sample: 0.05, budget_per_day: 1000, concurrency: 8}}
  copied: {{to: candidate, sample: 1.0, budget_per_day: 1000, concurrency: 8}}
quality: {{path: quality.sqlite3, check_every_s: 1}}
logging: {{level: warning}}
"""


ROWS = ("current", "chat", "guarded", "mirrored", "copied")  # the model by name first: the baseline


def run(requests: int = 3000, warmup: int = 300) -> dict[str, Any]:
    return asyncio.run(_main(requests, warmup))


async def _main(requests: int, warmup: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="triage-split-") as tmp, Fleet(Path(tmp)) as fleet:
        async with aiohttp.ClientSession() as http:
            up = fleet.upstream()
            await up.wait_ready(http, 20)
            (Path(tmp) / "policy.yaml").write_text(POLICY.format(base=up.base))
            port = free_port()
            argv = [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(Path(tmp) / "policy.yaml")]
            gw = fleet.add(
                Proc("triage", [*argv, "--port", str(port), "--no-watch"], port, "/health", Path(tmp) / "gw.log")
            )
            await gw.wait_ready(http, 60)
            times: dict[str, list[float]] = {m: [] for m in ROWS}
            for i in range(warmup + requests):
                for model in ROWS[i % len(ROWS) :] + ROWS[: i % len(ROWS)]:  # each row in each place in turn
                    body = {"model": model, "user": f"u{i}", "messages": [{"role": "user", "content": "hi"}]}
                    t0 = time.perf_counter()
                    async with http.post(gw.base + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        assert r.status == 200, r.status
                    if i >= warmup:
                        times[model].append((time.perf_counter() - t0) * 1000)
    out = {m: {"p50_ms": statistics.median(t), "p99_ms": sorted(t)[int(len(t) * 0.99)]} for m, t in times.items()}
    base = out["current"]["p50_ms"]
    report: dict[str, Any] = {"requests": requests, "by_name": out["current"]}
    for row, model in (
        ("split", "chat"),
        ("guarded_split", "guarded"),
        ("mirror_5pct", "mirrored"),
        ("mirror_all", "copied"),
    ):
        added = out[model]["p50_ms"] - base
        report[row] = {
            **out[model],
            "added_p50_ms": added,
            "ratio_p50": out[model]["p50_ms"] / base,
            "met": added <= 0.05,
        }
    return report
