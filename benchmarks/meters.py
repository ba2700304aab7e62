"""CPU time, from /proc: of the servers per request, and of the processes outside the benchmark."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from backends.native import cpu
from benchmarks.procs import Proc


def cpu_kind() -> str:
    """The CPU and the kind of kernels it runs (AVX2, AVX-512 VNNI, + AMX), as every figure names it."""
    c = cpu()
    return f"{c.model}, {os.cpu_count()} cores, {c.kind}"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds of every live process in process group ``pgid`` (a server started in a session of
    its own, with the workers it spawned: vLLM's engine process)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def group_switches(pgid: int) -> tuple[int, int]:
    """Context switches (voluntary, involuntary: preempted) of every thread of every live process in
    process group ``pgid``. Involuntary ones count the times the scheduler took a core from the
    gateway while it had work: contention for the cores, not the gateway's own work."""
    vol = invol = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            tasks = list((stat.parent / "task").glob("[0-9]*/status"))
        except OSError:
            continue
        for status in tasks:
            try:
                lines = status.read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                if line.startswith("voluntary_ctxt_switches:"):
                    vol += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    invol += int(line.split()[1])
    return vol, invol


def busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(f[i]) for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")


def foreign(procs: dict[str, Proc]) -> Callable[[], float]:
    """Mean cores used by processes outside this benchmark while it measured: noise to report."""

    def ours() -> float:
        return time.process_time() + sum(group_cpu_s(p.pid) for p in procs.values())

    t0, b0, o0 = time.monotonic(), busy_s(), ours()

    def done() -> float:
        wall = time.monotonic() - t0
        return round(max(0.0, (busy_s() - b0) - (ours() - o0)) / wall, 2) if wall > 0 else 0.0

    return done


def per_request(procs: dict[str, Proc], name: str) -> Callable[[int], dict[str, float]]:
    """CPU ms per request of the gateway under test (its whole process group: every worker of
    ``--workers``), of the upstream, and of this load generator."""
    gw, up = procs[name], procs["direct"]
    t0 = {"gw": group_cpu_s(gw.pid), "up": cpu_s(up.pid), "client": time.process_time()}

    def done(n: int) -> dict[str, float]:
        if n == 0:
            return {}
        d = {"up": cpu_s(up.pid) - t0["up"], "client": time.process_time() - t0["client"]}
        out = {
            "upstream_cpu_ms_per_req": round(d["up"] / n * 1000, 4),
            "client_cpu_ms_per_req": round(d["client"] / n * 1000, 4),
        }
        if name != "direct":
            out["gateway_cpu_ms_per_req"] = round((group_cpu_s(gw.pid) - t0["gw"]) / n * 1000, 4)
        return out

    return done
