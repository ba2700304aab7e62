"""The load generator: one aiohttp session per target, keep-alive, a fixed small chat body.

Two shapes of load, both bounded by a request count and a deadline:
- :func:`sequential`: requests one after another (concurrency 1), for latency;
- :func:`closed_loop`: ``c`` workers each sending its next request when the last one answered,
  for a fixed time, for throughput (and the latency that comes with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

BODY = orjson.dumps({"model": "bench", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
TIMEOUT = aiohttp.ClientTimeout(total=30)


class BadAnswer(RuntimeError):
    """A target answered something that is not a chat completion."""


@dataclass
class Target:
    name: str
    url: str  # the full chat completions URL
    session: aiohttp.ClientSession | None = None
    bodies: Iterator[bytes] | None = None  # each request's body (None: BODY every time)

    async def open(self, max_conns: int) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_conns, keepalive_timeout=60, force_close=False), timeout=TIMEOUT
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def once(self) -> float:
        """One request; its latency in seconds. Raises on a non-200 answer."""
        assert self.session is not None
        body = BODY if self.bodies is None else next(self.bodies)
        t0 = time.perf_counter()
        async with self.session.post(self.url, data=body, headers=HEADERS) as r:
            raw = await r.read()
        dt = time.perf_counter() - t0
        if r.status != 200:
            raise BadAnswer(f"{self.name}: HTTP {r.status}: {raw[:300].decode('utf-8', 'replace')}")
        return dt

    async def check(self) -> None:
        """One request whose answer is parsed: the target really proxies a chat completion."""
        assert self.session is not None
        async with self.session.post(self.url, data=BODY, headers=HEADERS) as r:
            raw = await r.read()
        if r.status != 200:
            raise BadAnswer(f"{self.name}: HTTP {r.status}: {raw[:300].decode('utf-8', 'replace')}")
        body = orjson.loads(raw)
        if not body.get("choices") or not body["choices"][0].get("message", {}).get("content"):
            raise BadAnswer(f"{self.name}: not a chat completion: {raw[:300]!r}")


@dataclass
class Sample:
    """Latencies (seconds) of one measurement, with its errors and wall time."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None
    wall_s: float = 0.0

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        if self.first_error is None:
            self.first_error = f"{type(exc).__name__}: {exc}"[:300]

    def extend(self, other: Sample) -> None:
        self.latencies.extend(other.latencies)
        self.errors += other.errors
        self.first_error = self.first_error or other.first_error
        self.wall_s += other.wall_s

    def summary(self) -> dict[str, Any]:
        xs = sorted(self.latencies)
        out: dict[str, Any] = {
            "n": len(xs),
            "errors": self.errors,
            "wall_s": round(self.wall_s, 3),
            "rps": round(len(xs) / self.wall_s, 1) if self.wall_s > 0 else 0.0,
        }
        for name, q in (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99)):
            out[name] = round(percentile(xs, q) * 1000, 3)
        out["mean_ms"] = round(sum(xs) / len(xs) * 1000, 3) if xs else math.nan
        if self.first_error:
            out["first_error"] = self.first_error
        return out


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks; ``xs`` sorted. NaN when empty."""
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


_ERRORS = (aiohttp.ClientError, TimeoutError, BadAnswer)


async def sequential(target: Target, n: int, deadline: float) -> Sample:
    """``n`` requests one after another, stopping early at ``deadline`` (monotonic)."""
    s = Sample()
    t0 = time.perf_counter()
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        try:
            s.latencies.append(await target.once())
        except _ERRORS as exc:
            s.error(exc)
    s.wall_s = time.perf_counter() - t0
    return s


async def closed_loop(target: Target, concurrency: int, duration_s: float, max_requests: int = 10_000_000) -> Sample:
    """``concurrency`` workers for ``duration_s``; each worker first sends one unmeasured request
    so that its connection is open before the clock starts."""
    s = Sample()
    await asyncio.gather(*(_quiet(target) for _ in range(concurrency)))
    budget = [max_requests]
    t0 = time.perf_counter()
    stop_at = t0 + duration_s

    async def worker() -> None:
        while time.perf_counter() < stop_at and budget[0] > 0:
            budget[0] -= 1
            try:
                s.latencies.append(await target.once())
            except _ERRORS as exc:
                s.error(exc)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    s.wall_s = time.perf_counter() - t0
    return s


async def _quiet(target: Target) -> None:
    with contextlib.suppress(*_ERRORS):
        await target.once()


async def interleaved(targets: list[Target], rounds: int, requests: int, warmup: int) -> dict[str, Sample]:
    """Each target warmed up, then ``requests`` sequential requests each in ``rounds`` rounds whose
    order rotates (the machine's noise falls on every target alike); their latencies by name."""
    deadline = time.monotonic() + 3600
    for t in targets:
        await sequential(t, warmup, deadline)
    per_round = max(1, requests // rounds)
    lat = {t.name: Sample() for t in targets}
    for r in range(rounds):
        k = r % len(targets)
        for t in targets[k:] + targets[:k]:
            lat[t.name].extend(await sequential(t, per_round, deadline))
    return lat
