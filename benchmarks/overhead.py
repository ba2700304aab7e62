"""``python -m benchmarks overhead``: what a gateway adds on top of a fast upstream, in one run.

One tiny upstream (:mod:`benchmarks.upstream`), and in front of it: nothing (``direct``), triage
with request logging off (``triage``: level warning), triage logging one event per request
(``triage-info``), the LiteLLM proxy, and, with ``--workers N``, ``triage serve --workers N``
(``triage-wN``, logging as ``triage``) beside the one process, and, with ``--baseline DIR``, another
checkout of triage (``triage-baseline``: a before/after pair of a change, in the same run). The load
generator runs in this process:
1. latency at concurrency 1, in rounds whose target order rotates, so that machine noise
   falls on every target alike; added latency is the target's percentile minus direct's;
2. a throughput sweep over concurrency levels, interleaved the same way: the best requests/s
   whose p99 stays under the limit;
3. throughput at one fixed concurrency, with each server's CPU time per request;
4. with ``--workers N``, saturation throughput of one worker and of N in interleaved rounds at that
   concurrency (median of each, and their ratio);
5. optionally, a profile of triage under that fixed load.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from benchmarks import meters, report
from benchmarks import profile as prof
from benchmarks.load import BadAnswer, Sample, Target, closed_loop, sequential
from benchmarks.procs import Fleet, Proc, StartFailed, litellm_exe
from benchmarks.report import goals, render

READY_S = {"upstream": 20.0, "triage": 60.0, "triage-info": 60.0, "litellm": 180.0}


@dataclass(frozen=True)
class Options:
    requests: int = 2000
    concurrency: int = 32
    duration: float = 10.0
    with_litellm: bool = True
    with_logging_row: bool = True
    workers: int = 1  # N > 1: also `triage serve --workers N`, the row triage-wN
    traced: tuple[float, ...] = ()  # also triage with tracing on, one row per sample ratio (triage-traced-R)
    baseline: Path | None = None  # another checkout of triage, the row triage-baseline: a before/after pair
    pair_rounds: int = 6  # with workers: interleaved rounds of one worker against N, at `concurrency`
    pair_duration: float = 3.0
    sweep_duration: float = 3.0
    max_concurrency: int = 64
    rounds: int = 10
    warmup: int = 200
    p99_limit_ms: float = 100.0
    time_cap_s: float = 900.0
    profile: bool = False
    profile_duration: float = 10.0
    out: Path = Path("out/bench-overhead.json")
    plot: Path | None = None  # also a PNG of added latency and throughput against concurrency

    def levels(self) -> list[int]:
        out, c = [], 1
        while c <= self.max_concurrency:
            out.append(c)
            c *= 2
        return out


def workers_row(workers: int) -> str | None:
    """The row of ``triage serve --workers N`` (None: one process only)."""
    return f"triage-w{workers}" if workers > 1 else None


def run(**kwargs: Any) -> dict[str, Any]:
    """Run the benchmark, print its tables and write its JSON report; returns the report."""
    opts = Options(**kwargs)
    console = Console()
    with tempfile.TemporaryDirectory(prefix="triage-bench-") as tmp:
        result = _run_loop(_main(opts, console, Path(tmp)))
    render(console, result)
    report.save(console, opts.out, result)
    if opts.plot is not None:
        from benchmarks.overhead_plot import draw

        console.print(f"plot: {draw(result, opts.plot)}")
    return result


def _run_loop(coro: Any) -> Any:
    import uvloop  # the client's own loop is as lean as the servers'

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def machine() -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": meters.cpu_kind(),
        "python": sys.version.split()[0],
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("triage", "fastapi", "uvicorn", "aiohttp", "uvloop"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    python = litellm_exe().with_name("python")  # the proxy's own virtualenv
    if python.exists():
        ask = "import importlib.metadata as m; print(m.version('litellm'))"
        said = subprocess.run([str(python), "-c", ask], capture_output=True, text=True, timeout=60)
        if said.returncode == 0:
            out["litellm (proxy)"] = said.stdout.strip()
    return out


async def _main(opts: Options, console: Console, workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "machine": machine(),
        "settings": {
            **asdict(opts),
            "out": str(opts.out),
            "baseline": str(opts.baseline or ""),
            "plot": str(opts.plot or ""),
            "levels": opts.levels(),
        },
        "targets": {},
        "latency": {},
        "sweep": {},
        "best": {},
        "fixed": {},
    }
    deadline = time.monotonic() + opts.time_cap_s
    async with aiohttp.ClientSession() as probe:
        with Fleet(workdir) as fleet:
            procs = await _start(opts, fleet, probe, result, console)
            targets = await _targets(opts, procs, result, console)
            try:
                others = meters.foreign(procs)
                await _measure(opts, targets, procs, result, console, deadline)
                result["machine"]["other_cpu_cores"] = others()
                if opts.profile:
                    result["profile"] = await _profile(opts, fleet, procs, probe, console)
            finally:
                for t in targets:
                    await t.close()
    result["goals"] = goals(result)
    return result


async def _start(
    opts: Options, fleet: Fleet, probe: aiohttp.ClientSession, result: dict[str, Any], console: Console
) -> dict[str, Proc]:
    multi = workers_row(opts.workers)
    traced = {f"triage-traced-{r:g}": r for r in opts.traced}
    names = [
        "upstream",
        "triage",
        *([multi] if multi else []),
        *traced,
        *(["triage-baseline"] if opts.baseline is not None else []),
        *(["triage-info"] if opts.with_logging_row else []),
        *(["litellm"] if opts.with_litellm else []),
    ]
    console.print(f"[bold]starting servers[/] ({', '.join(names)})")
    up = fleet.upstream()
    await up.wait_ready(probe, READY_S["upstream"])
    procs = {"direct": up, "triage": fleet.triage("triage", up, "warning")}
    if multi:
        procs[multi] = fleet.triage(multi, up, "warning", workers=opts.workers)
    for name, ratio in traced.items():
        procs[name] = fleet.triage(name, up, "warning", traced=ratio)
    if opts.baseline is not None:
        procs["triage-baseline"] = fleet.triage("triage-baseline", up, "warning", source=opts.baseline.resolve())
    if opts.with_logging_row:
        procs["triage-info"] = fleet.triage("triage-info", up, "info")
    if opts.with_litellm:
        try:
            procs["litellm"] = fleet.litellm(up)
        except StartFailed as exc:
            result["targets"]["litellm"] = {"status": "missing", "reason": str(exc)}
    for name, p in list(procs.items())[1:]:
        try:
            await p.wait_ready(probe, READY_S.get(name, READY_S["triage"]))
            if name == multi:
                await p.wait_workers(probe, opts.workers, READY_S["triage"])
        except StartFailed as exc:
            if name != "litellm":
                raise
            p.stop()
            del procs[name]
            result["targets"]["litellm"] = {"status": "missing", "reason": str(exc)}
    return procs


async def _targets(opts: Options, procs: dict[str, Proc], result: dict[str, Any], console: Console) -> list[Target]:
    targets: list[Target] = []
    conns = max([*opts.levels(), opts.concurrency]) + 8
    for name, p in list(procs.items()):
        t = Target(name, p.base + "/v1/chat/completions")
        await t.open(conns)
        try:
            await t.check()
        except (BadAnswer, aiohttp.ClientError, TimeoutError) as exc:
            await t.close()
            if name != "litellm":
                for opened in targets:
                    await opened.close()
                raise
            procs.pop(name).stop()
            result["targets"][name] = {"status": "missing", "reason": f"answers, but not a chat completion: {exc}"}
            continue
        result["targets"][name] = {"status": "ok", "url": t.url, "pid": p.pid}
        targets.append(t)
    if "litellm" in result["targets"] and result["targets"]["litellm"]["status"] != "ok":
        console.print(f"[yellow]LiteLLM proxy missing:[/] {result['targets']['litellm']['reason']}")
    return targets


def _rotate(xs: list[Target], k: int) -> list[Target]:
    k %= len(xs)
    return xs[k:] + xs[:k]


async def _measure(
    opts: Options,
    targets: list[Target],
    procs: dict[str, Proc],
    result: dict[str, Any],
    console: Console,
    deadline: float,
) -> None:
    console.print(f"[bold]warm-up[/]: {opts.warmup} requests per target")
    for t in targets:
        await sequential(t, opts.warmup, deadline)

    per_round = max(1, opts.requests // opts.rounds)
    console.print(f"[bold]latency[/]: {opts.rounds} rounds x {per_round} sequential requests per target")
    lat = {t.name: Sample() for t in targets}
    cpu = {t.name: 0.0 for t in targets}  # the gateway's CPU seconds in its own rounds: work, not waiting
    for r in range(opts.rounds):
        for t in _rotate(targets, r):
            before = meters.group_cpu_s(procs[t.name].pid)
            lat[t.name].extend(await sequential(t, per_round, deadline))
            cpu[t.name] += meters.group_cpu_s(procs[t.name].pid) - before
    result["latency"] = {name: s.summary() for name, s in lat.items()}
    base = result["latency"]["direct"]
    for name, s in result["latency"].items():
        s["added_p50_ms"] = round(s["p50_ms"] - base["p50_ms"], 3)
        s["added_p99_ms"] = round(s["p99_ms"] - base["p99_ms"], 3)
        if s["n"]:  # at concurrency 1 a request's CPU is on its path: the rest of its time is waiting
            s["cpu_ms_per_req"] = round(cpu[name] / s["n"] * 1000, 4)

    console.print(
        f"[bold]throughput sweep[/]: levels {opts.levels()}, {opts.sweep_duration:g} s each, "
        f"a target leaves the sweep at its first level with p99 over {opts.p99_limit_ms:g} ms"
    )
    sweep: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
    alive = list(targets)
    for i, c in enumerate(opts.levels()):
        for t in _rotate(alive, i):
            if time.monotonic() > deadline:
                break
            s = (await closed_loop(t, c, opts.sweep_duration)).summary()
            sweep[t.name].append({"concurrency": c, **s})
            if s["p99_ms"] > opts.p99_limit_ms or s["errors"]:
                alive.remove(t)
    result["sweep"] = sweep
    for name, rows in sweep.items():
        ok = [r for r in rows if r["p99_ms"] <= opts.p99_limit_ms and not r["errors"]]
        best = max(ok, key=lambda r: r["rps"], default=None)
        result["best"][name] = (
            {"rps": best["rps"], "concurrency": best["concurrency"], "p99_ms": best["p99_ms"]} if best else None
        )

    console.print(f"[bold]fixed concurrency[/]: {opts.concurrency} for {opts.duration:g} s per target")
    for t in targets:
        cpu = meters.per_request(procs, t.name)
        s = await closed_loop(t, opts.concurrency, opts.duration)
        row = {"concurrency": opts.concurrency, **s.summary(), **cpu(len(s.latencies))}
        result["fixed"][t.name] = row

    multi = workers_row(opts.workers)
    if multi and opts.pair_rounds > 0:
        by_name = {t.name: t for t in targets}
        pair = await _workers_pair(opts, by_name["triage"], by_name[multi], procs, console, deadline)
        result["workers_pair"] = pair


async def _workers_pair(
    opts: Options, one: Target, many: Target, procs: dict[str, Proc], console: Console, deadline: float
) -> dict[str, Any]:
    """Saturation throughput of one worker and of ``--workers N`` in interleaved rounds (the order
    flips each round), so that the machine's noise falls on both alike: the median of each, their
    ratio, and each round's ratio."""
    c, d = opts.concurrency, opts.pair_duration
    console.print(
        f"[bold]workers pair[/]: {opts.pair_rounds} rounds of {one.name} and {many.name} in turn, "
        f"concurrency {c}, {d:g} s each"
    )
    rps: dict[str, list[float]] = {one.name: [], many.name: []}
    cpu = {one.name: 0.0, many.name: 0.0}
    done = {one.name: 0, many.name: 0}
    switches = {one.name: [0, 0], many.name: [0, 0]}  # voluntary, involuntary
    for r in range(opts.pair_rounds):
        if time.monotonic() > deadline:
            break
        for t in (one, many) if r % 2 == 0 else (many, one):
            c0, w0 = meters.group_cpu_s(procs[t.name].pid), meters.group_switches(procs[t.name].pid)
            s = await closed_loop(t, c, d)
            cpu[t.name] += meters.group_cpu_s(procs[t.name].pid) - c0
            w1 = meters.group_switches(procs[t.name].pid)
            switches[t.name] = [switches[t.name][k] + w1[k] - w0[k] for k in (0, 1)]
            done[t.name] += len(s.latencies)
            rps[t.name].append(s.summary()["rps"] if not s.errors else 0.0)
    medians = {name: statistics.median(xs) if xs else 0.0 for name, xs in rps.items()}
    # requests per second of gateway CPU: the same for N workers as for one when each added core
    # serves as much as the first (the load generator and the upstream share the machine, so the
    # cores a row gets are measured, not assumed)
    per_core = {name: done[name] / cpu[name] if cpu[name] > 0 else None for name in cpu}
    a, b = per_core[one.name], per_core[many.name]
    return {
        "concurrency": c,
        "duration_s": d,
        "rounds": len(rps[one.name]),
        "rps": rps,
        "median_rps": medians,
        "ratio_median": medians[many.name] / medians[one.name] if medians[one.name] else None,
        "ratio_rounds": [m / o if o else None for o, m in zip(rps[one.name], rps[many.name], strict=True)],
        "gateway_cpu_ms_per_req": {
            name: round(cpu[name] / done[name] * 1000, 4) if done[name] else None for name in cpu
        },
        "gateway_cores": {name: round(cpu[name] / (d * max(1, len(xs))), 3) for name, xs in rps.items()},
        "rps_per_core": {name: round(x, 1) if x is not None else None for name, x in per_core.items()},
        # per request: how often the gateway waited for work (voluntary) and how often it was
        # preempted while it had some (involuntary: the cores are contended)
        "switches_per_req": {
            name: {"voluntary": round(v / done[name], 3), "involuntary": round(i / done[name], 3)}
            if done[name]
            else None
            for name, (v, i) in switches.items()
        },
        "core_efficiency": round(b / a, 3) if a and b else None,
    }


async def _profile(
    opts: Options, fleet: Fleet, procs: dict[str, Proc], probe: aiohttp.ClientSession, console: Console
) -> dict[str, Any]:
    exe = prof.pyspy()
    tri = procs["triage"]
    if exe is not None:
        console.print(
            f"[bold]profile[/]: py-spy on triage (pid {tri.pid}), concurrency {opts.concurrency}, "
            f"{opts.profile_duration:g} s"
        )
        t = Target("triage", tri.base + "/v1/chat/completions")
        await t.open(opts.concurrency + 8)
        try:
            load = asyncio.create_task(closed_loop(t, opts.concurrency, opts.profile_duration + 2))
            await asyncio.sleep(0.5)
            try:
                p = await prof.record_pyspy(exe, tri.pid, opts.profile_duration, fleet.workdir / "spy.txt")
            except RuntimeError as exc:
                console.print(f"[yellow]py-spy failed, falling back to cProfile:[/] {exc}")
                p = None
            s = await load
        finally:
            await t.close()
        if p is not None:
            p.note = "; ".join(x for x in (f"{s.summary()['rps']} req/s under the profiler", p.note) if x)
            return p.as_dict()
    return await _profile_cprofile(opts, fleet, procs, probe, console)


async def _profile_cprofile(
    opts: Options, fleet: Fleet, procs: dict[str, Proc], probe: aiohttp.ClientSession, console: Console
) -> dict[str, Any]:
    console.print(
        f"[bold]profile[/]: triage under cProfile, concurrency {opts.concurrency}, "
        f"{opts.profile_duration:g} s (py-spy not installed)"
    )
    stats = fleet.workdir / "triage.pstats"
    p = fleet.triage("triage-cprofile", procs["direct"], "warning", pre=["-m", "cProfile", "-o", str(stats)])
    await p.wait_ready(probe, READY_S["triage"])
    t = Target("triage-cprofile", p.base + "/v1/chat/completions")
    await t.open(opts.concurrency + 8)
    try:
        await closed_loop(t, opts.concurrency, opts.profile_duration)
    finally:
        await t.close()
        # uvicorn re-raises the signal after its shutdown: SIGINT becomes KeyboardInterrupt, which
        # lets cProfile write its stats on the way out (SIGTERM would end the process first)
        p.stop(grace_s=20, sig=signal.SIGINT)
    with contextlib.suppress(FileNotFoundError):
        return prof.parse_pstats(stats).as_dict()
    return {"tool": "cProfile", "error": f"no stats written:\n{p.log_tail()}"}
