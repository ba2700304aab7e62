"""The overhead benchmark's goals and its printed tables (rich)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from benchmarks.profile import NATIVE

# the goals for triage against the LiteLLM proxy
ADDED_P50_MAX_MS = 0.4  # issue 35's goals
ADDED_P99_MAX_MS = 1.0
ADDED_P50_MAX_RATIO = 0.3
THROUGHPUT_MIN_RATIO = 30.0
# issue 18: `triage serve --workers 2` against one worker, on two cores (the best rate of the sweep)
WORKERS_MIN_RATIO = 1.7
CORE_EFFICIENCY_MIN = 0.9  # issue 35: throughput per worker-core, N workers against one


def save(console: Console, out: Path, result: dict[str, Any]) -> None:
    """Write a benchmark's JSON report (numpy values too) and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    console.print(f"report: {out}")


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    lat, best, fixed = res["latency"], res["best"], res["fixed"]
    tri_added = lat.get("triage", {}).get("added_p50_ms")
    lit_added = lat.get("litellm", {}).get("added_p50_ms")
    tri_best = (best.get("triage") or {}).get("rps")
    lit_best = (best.get("litellm") or {}).get("rps")
    no_litellm = "litellm" not in lat
    tri_p99 = lat.get("triage", {}).get("added_p99_ms")
    rows = [
        {
            "goal": f"triage added p50 <= {ADDED_P50_MAX_MS:g} ms",
            "value": tri_added,
            "unit": "ms",
            "pass": tri_added is not None and tri_added <= ADDED_P50_MAX_MS,
        },
        {
            "goal": f"triage added p99 <= {ADDED_P99_MAX_MS:g} ms",
            "value": tri_p99,
            "unit": "ms",
            "pass": tri_p99 is not None and tri_p99 <= ADDED_P99_MAX_MS,
        },
        {
            "goal": f"triage added p50 <= {ADDED_P50_MAX_RATIO:g}x LiteLLM's",
            "value": _ratio(tri_added, lit_added),
            "unit": "x",
            "pass": None
            if no_litellm
            else (r := _ratio(tri_added, lit_added)) is not None and r <= ADDED_P50_MAX_RATIO,
        },
        {
            "goal": f"triage throughput (best, p99 under limit) >= {THROUGHPUT_MIN_RATIO:g}x LiteLLM's",
            "value": _ratio(tri_best, lit_best),
            "unit": "x",
            "pass": None if no_litellm else (r := _ratio(tri_best, lit_best)) is not None and r >= THROUGHPUT_MIN_RATIO,
        },
    ]
    fixed_ratio = _ratio(fixed.get("triage", {}).get("rps"), fixed.get("litellm", {}).get("rps"))
    rows.append(
        {
            "goal": "(info) triage / LiteLLM throughput at the fixed concurrency",
            "value": fixed_ratio,
            "unit": "x",
            "pass": None,
        }
    )
    cpu = _ratio(
        fixed.get("litellm", {}).get("gateway_cpu_ms_per_req"), fixed.get("triage", {}).get("gateway_cpu_ms_per_req")
    )
    rows.append({"goal": "(info) LiteLLM / triage gateway CPU per request", "value": cpu, "unit": "x", "pass": None})
    return rows + _workers_goals(res)


def _workers_goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    """``triage serve --workers N`` (the row triage-wN) against one worker, measured in the same run."""
    best, fixed = res["best"], res["fixed"]
    multi = next((name for name in best if name.startswith("triage-w")), None)
    if multi is None:
        return []
    n = int(multi.removeprefix("triage-w"))
    ratio = _ratio((best.get(multi) or {}).get("rps"), (best.get("triage") or {}).get("rps"))
    rows = [
        {
            "goal": f"--workers {n} throughput (best, p99 under limit) >= {WORKERS_MIN_RATIO}x one worker's"
            + ("" if n == 2 else " (the goal is for 2 workers: info)"),
            "value": ratio,
            "unit": "x",
            "pass": (ratio is not None and ratio >= WORKERS_MIN_RATIO) if n == 2 else None,
        }
    ]
    if pair := res.get("workers_pair"):
        rows.append(
            {
                "goal": f"(info) --workers {n} / one worker, median of {pair['rounds']} interleaved rounds at "
                f"concurrency {pair['concurrency']}",
                "value": pair.get("ratio_median"),
                "unit": "x",
                "pass": None,
            }
        )
        eff = pair.get("core_efficiency")
        rows.append(
            {
                "goal": f"requests per gateway CPU-second, --workers {n} / one worker >= {CORE_EFFICIENCY_MIN} "
                "(scaling efficiency per added core)",
                "value": eff,
                "unit": "x",
                "pass": None if eff is None else eff >= CORE_EFFICIENCY_MIN,
            }
        )
    rows.append(
        {
            "goal": f"(info) --workers {n} / one worker, throughput at the fixed concurrency",
            "value": _ratio(fixed.get(multi, {}).get("rps"), fixed.get("triage", {}).get("rps")),
            "unit": "x",
            "pass": None,
        }
    )
    rows.append(
        {
            "goal": f"(info) the most --workers {n} can gain on these cores (client and upstream on them too)",
            "value": _cpu_bound_ratio(res, n),
            "unit": "x",
            "pass": None,
        }
    )
    rows.append(
        {
            "goal": f"(info) --workers {n} / one worker, gateway CPU per request",
            "value": _ratio(
                fixed.get(multi, {}).get("gateway_cpu_ms_per_req"),
                fixed.get("triage", {}).get("gateway_cpu_ms_per_req"),
            ),
            "unit": "x",
            "pass": None,
        }
    )
    return rows


def _cpu_bound_ratio(res: dict[str, Any], n: int) -> float | None:
    """The throughput ratio the machine's CPUs allow N workers against one, from one worker's CPU per
    request at the fixed concurrency (gateway g, upstream u, client c; every process on the same
    cores): one worker does at most min(1/g, cores/(g+u+c)) requests a second, N at most
    min(n/g, cores/(g+u+c)). Other processes' load lowers both."""
    row = res["fixed"].get("triage", {})
    g, u, c = (row.get(k) for k in ("gateway_cpu_ms_per_req", "upstream_cpu_ms_per_req", "client_cpu_ms_per_req"))
    cores = res["machine"].get("affinity") or res["machine"].get("nproc")
    if not (g and u is not None and c is not None and cores):
        return None
    all_of_it = cores / (g + u + c)
    return min(n / g, all_of_it) / min(1 / g, all_of_it)


def _pair_table(res: dict[str, Any]) -> Table:
    p = res["workers_pair"]
    one, many = list(p["rps"])
    t = Table(
        title=f"Workers pair: {one} and {many} in turn, concurrency {p['concurrency']}, {p['duration_s']:g} s "
        "each (req/s; the order flips each round)",
        title_justify="left",
    )
    for col in ("round", one, many, "ratio"):
        t.add_column(col, justify="right")
    for i, (a, b, r) in enumerate(zip(p["rps"][one], p["rps"][many], p["ratio_rounds"], strict=True)):
        t.add_row(str(i + 1), f"{a:.0f}", f"{b:.0f}", "-" if r is None else f"{r:.3f}")
    ratio = p["ratio_median"]
    t.add_row(
        "[bold]median[/]",
        f"[bold]{p['median_rps'][one]:.0f}[/]",
        f"[bold]{p['median_rps'][many]:.0f}[/]",
        "-" if ratio is None else f"[bold]{ratio:.3f}[/]",
    )
    cpu = p["gateway_cpu_ms_per_req"]
    t.add_row("gateway CPU ms/req", _ms(cpu.get(one)), _ms(cpu.get(many)), "")
    if "rps_per_core" in p:
        cores, per_core, eff = p["gateway_cores"], p["rps_per_core"], p.get("core_efficiency")
        t.add_row("gateway cores busy", _ms(cores.get(one)), _ms(cores.get(many)), "")
        t.add_row(
            "req/s per gateway core",
            _ms(per_core.get(one)),
            _ms(per_core.get(many)),
            "-" if eff is None else f"[bold]{eff:.3f}[/]",
        )
    if sw := p.get("switches_per_req"):
        for kind in ("voluntary", "involuntary"):
            a, b = ((sw.get(n) or {}).get(kind) for n in (one, many))
            t.add_row(f"{kind} switches/req", _ms(a), _ms(b), "")
    return t


def _ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _latency_table(res: dict[str, Any]) -> Table:
    t = Table(title="Latency at concurrency 1 (ms; added = target - direct)", title_justify="left")
    for col in ("target", "n", "p50", "p90", "p99", "added p50", "added p99", "server CPU a request", "errors"):
        t.add_column(col, justify="left" if col == "target" else "right", no_wrap=col == "target")
    for name, s in res["latency"].items():
        t.add_row(
            name,
            str(s["n"]),
            _ms(s["p50_ms"]),
            _ms(s["p90_ms"]),
            _ms(s["p99_ms"]),
            "-" if name == "direct" else _ms(s["added_p50_ms"]),
            "-" if name == "direct" else _ms(s["added_p99_ms"]),
            _ms(s.get("cpu_ms_per_req")),
            str(s["errors"]),
        )
    return t


def _sweep_table(res: dict[str, Any]) -> Table:
    limit = res["settings"]["p99_limit_ms"]
    t = Table(
        title=f"Throughput sweep (req/s | p99 ms; {res['settings']['sweep_duration']:g} s per cell; "
        f"red: p99 over {limit:g} ms, the target leaves the sweep)",
        title_justify="left",
    )
    t.add_column("concurrency", justify="right")
    names = list(res["sweep"])
    for name in names:
        t.add_column(name, justify="right", no_wrap=True)
    by = {n: {r["concurrency"]: r for r in rows} for n, rows in res["sweep"].items()}
    for c in res["settings"]["levels"]:
        cells = []
        for n in names:
            r = by[n].get(c)
            if r is None:
                cells.append("")
                continue
            cell = f"{r['rps']:.0f} | {r['p99_ms']:.1f}" + (f" ({r['errors']} err)" if r["errors"] else "")
            cells.append(f"[red]{cell}[/]" if r["p99_ms"] > limit or r["errors"] else cell)
        t.add_row(str(c), *cells)
    best = [res["best"].get(n) for n in names]
    t.add_row(
        f"[bold]best, p99 < {limit:g}[/]",
        *(f"[bold]{b['rps']:.0f}[/] at c={b['concurrency']}" if b else "none" for b in best),
    )
    return t


def _fixed_table(res: dict[str, Any]) -> Table:
    c = res["settings"]["concurrency"]
    t = Table(
        title=f"Fixed concurrency {c}, {res['settings']['duration']:g} s (CPU ms per request, measured from /proc)",
        title_justify="left",
    )
    for col in (
        "target",
        "req/s",
        "p50",
        "p99",
        "gateway CPU",
        "req/s per gateway core",
        "upstream CPU",
        "client CPU",
        "errors",
    ):
        t.add_column(col, justify="left" if col == "target" else "right", no_wrap=col == "target")
    for name, s in res["fixed"].items():
        gw = s.get("gateway_cpu_ms_per_req")
        t.add_row(
            name,
            f"{s['rps']:.0f}",
            _ms(s["p50_ms"]),
            _ms(s["p99_ms"]),
            _ms(gw),
            f"{1000 / gw:.0f}" if gw else "-",
            _ms(s.get("upstream_cpu_ms_per_req")),
            _ms(s.get("client_cpu_ms_per_req")),
            str(s["errors"]),
        )
    return t


def goals_table(goals: list[dict[str, Any]], title: str = "Goals", unmeasured: str = "-") -> Table:
    """PASS/MISS per goal; a goal without a verdict shows ``unmeasured`` ((info) rows: blank)."""
    t = Table(title=title, title_justify="left")
    for col in ("goal", "measured", "result"):
        t.add_column(col, justify="left" if col == "goal" else "right")
    for g in goals:
        v = g["value"]
        measured = "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f} {g['unit']}".strip()
        if g["pass"] is None:
            verdict = "" if g["goal"].startswith("(info)") else unmeasured
        else:
            verdict = "[green]PASS[/]" if g["pass"] else "[red]MISS[/]"
        t.add_row(g["goal"], measured, verdict)
    return t


def _profile_tables(p: dict[str, Any]) -> list[Table]:
    if "error" in p:
        t = Table(title="Profile of triage: failed")
        t.add_column("why")
        t.add_row(p["error"])
        return [t]
    out = []
    views = (
        ("packages", "own time by package", 12, lambda n: True),
        ("own", "top functions by own time", 20, lambda n: True),
        (
            "cumulative",
            "triage's functions by cumulative time (run_asgi: all request handling)",
            20,
            lambda n: "(triage:" in n or n.startswith("RequestResponseCycle.run_asgi "),
        ),
    )
    for key, title, top, keep in views:
        unit = "samples" if p["tool"] == "py-spy" else "functions"
        t = Table(title=f"Profile of triage ({p['tool']}, {p['samples']} {unit}): {title}", title_justify="left")
        t.add_column("share", justify="right")
        t.add_column("where")
        for row in [r for r in p[key] if keep(r["name"])][:top]:
            func = row["name"].split(" (", 1)[0]
            note = f"  [dim]= {NATIVE[func]}[/]" if key == "own" and func in NATIVE else ""
            t.add_row(f"{row['share'] * 100:.1f}%", row["name"] + note)
        out.append(t)
    return out


def render(console: Console, res: dict[str, Any]) -> None:
    m = res["machine"]
    console.print()
    console.print(
        f"[bold]python -m benchmarks overhead[/]  {m['date']}  {m['platform']}  Python {m['python']}  "
        f"{m['nproc']} CPUs (affinity {m['affinity']}), load average before the run {m['load_avg'][0]}"
    )
    if "other_cpu_cores" in m:
        console.print(
            f"other processes on this machine used {m['other_cpu_cores']} cores on average "
            "while the bench measured" + (" [red](noisy run)[/]" if m["other_cpu_cores"] > 0.2 else "")
        )
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    console.print(
        f"[yellow]note:[/] the load generator (aiohttp, this process) shares the {m['nproc']} CPUs with "
        "the upstream and the gateway under test, and the idle servers stay up; absolute req/s are "
        "bounded by that, compare rows, not machines. Gateway CPU ms/request does not depend on it."
    )
    for name, t in res["targets"].items():
        if t["status"] != "ok":
            console.print(f"[red]{name} not measured:[/] {t['reason']}")
    for table in (
        _latency_table(res),
        _sweep_table(res),
        _fixed_table(res),
        *([_pair_table(res)] if res.get("workers_pair") else []),
        goals_table(res["goals"], "Goals (from the issue)", "n/a (no LiteLLM)"),
    ):
        console.print(table)
    if "profile" in res:
        for table in _profile_tables(res["profile"]):
            console.print(table)
        if res["profile"].get("note"):
            console.print(f"profile: {res['profile']['note']}")
