"""What ``python -m benchmarks affinity``'s run concludes and prints (``benchmarks/affinity.py``): the ratios
against round robin, the summary, the verdict on the goals, the table."""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.affinity import VLLM_ADMISSION_RPS_MIN


def _ratios(res: dict[str, Any]) -> None:
    """Per round: reuse, ratios against that round's round robin, the busier replica's shares."""
    ideal = res["batch"]["ideal_reuse"]
    for rnd in res["rounds"]:
        base = rnd["round_robin"]
        for row in rnd.values():
            ev, n = row["evaluated_tokens"], sum(row["requests"])
            row["reuse"] = None if ev is None else 1 - ev / row["prompt_tokens"]
            row["share_of_ideal"] = None if row["reuse"] is None or ideal <= 0 else row["reuse"] / ideal
            row["rps_x_baseline"] = row["rps"] / base["rps"]
            row["evaluated_x_baseline"] = (
                None if ev is None or not base["evaluated_tokens"] else ev / base["evaluated_tokens"]
            )
            row["busier_share_requests"] = max(row["requests"]) / n if n else None
            evs = row["evaluated_per_server"]
            row["busier_share_evaluated"] = None if None in evs or not ev else max(e or 0 for e in evs) / ev


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """Each mode over all rounds: requests over total wall time, evaluated tokens summed, ratios of
    those, and the spread of the per-round ratios."""
    rounds, ideal = res["rounds"], res["batch"]["ideal_reuse"]
    out: dict[str, Any] = {}
    for mode in rounds[0]:
        rows = [r[mode] for r in rounds]
        evs = [r["evaluated_tokens"] for r in rows]
        lat = sorted(x for r in rows for x in r["latencies_s"])
        ev = None if None in evs else sum(e for e in evs if e is not None)
        prompt = sum(r["prompt_tokens"] for r in rows)
        reuse = None if ev is None else 1 - ev / prompt
        out[mode] = {
            "wall_s": sum(r["wall_s"] for r in rows),
            "rps": sum(map(sum, (r["requests"] for r in rows))) / sum(r["wall_s"] for r in rows),
            "evaluated_tokens": ev,
            "prompt_tokens": prompt,
            "reuse": reuse,
            "share_of_ideal": None if reuse is None or ideal <= 0 else reuse / ideal,
            "predicted_reuse": None
            if rows[0]["predicted_reuse"] is None
            else statistics.fmean(r["predicted_reuse"] for r in rows),
            "latency_p50_s": statistics.median(lat),
            "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
            "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "busier_share_requests_mean": statistics.fmean(r["busier_share_requests"] for r in rows),
            "other_cpu_cores_mean": statistics.fmean(r["other_cpu_cores"] for r in rows),
            "utilization_mean": None
            if rows[0]["utilization"] is None
            else statistics.fmean(r["utilization"] for r in rows),
            "rps_x_baseline_per_round": [r["rps_x_baseline"] for r in rows],
            "evaluated_x_baseline_per_round": [r["evaluated_x_baseline"] for r in rows],
        }
    base = out["round_robin"]
    for row in out.values():
        row["rps_x_baseline"] = row["rps"] / base["rps"]
        row["evaluated_x_baseline"] = (
            None
            if row["evaluated_tokens"] is None or not base["evaluated_tokens"]
            else row["evaluated_tokens"] / base["evaluated_tokens"]
        )
    return out


def verdict(res: dict[str, Any]) -> dict[str, Any]:
    """Per mode against round robin: it helps when it is over 5% faster overall, never slower in a
    round, and evaluates fewer prompt tokens."""
    out: dict[str, Any] = {}
    texts = []
    for mode, a in res["summary"].items():
        if mode == "round_robin":
            continue
        speed, ev = a["rps_x_baseline"], a["evaluated_x_baseline"]
        per_round = a["rps_x_baseline_per_round"]
        helps = speed > 1.05 and min(per_round) >= 1.0 and (ev is None or ev < 1.0)
        out[mode] = {"helps": helps, "rps_x_baseline": speed, "evaluated_x_baseline": ev}
        splits = ", ".join(f"{r[mode]['requests'][0]}/{r[mode]['requests'][1]}" for r in res["rounds"])
        texts.append(
            f"{mode} {'helps' if helps else 'does not help'} here: {speed:.2f}x the requests/s of round "
            f"robin over {len(per_round)} round(s) (per round {', '.join(f'{x:.2f}x' for x in per_round)}), "
            f"{'-' if ev is None else f'{ev:.2f}x'} the prompt tokens evaluated; requests per replica "
            f"{splits}."
        )
    if res["settings"]["engine"] == "vllm" and "admission" in res["summary"]:
        a, base = res["summary"]["admission"], res["summary"]["round_robin"]
        met = a["rps_x_baseline"] >= VLLM_ADMISSION_RPS_MIN and a["latency_p99_s"] <= base["latency_p99_s"]
        out["vllm_goal"] = {"met": met, "rps_x_baseline": a["rps_x_baseline"], "p99_s": a["latency_p99_s"]}
        texts.append(
            f"Issue 19's goal (admission >= {VLLM_ADMISSION_RPS_MIN}x round robin at an equal or better p99): "
            f"{'met' if met else 'not met'}, {a['rps_x_baseline']:.2f}x at p99 {a['latency_p99_s']:.2f} s against "
            f"{base['latency_p99_s']:.2f} s."
        )
    if "affinity" in out:
        odds = res["split_odds"]
        texts.append(
            f"Over random replica addresses, {res['batch']['affinity_keys']} affinity keys put "
            f"{odds['busier_share_requests_mean']:.0%} of the requests on the busier replica on average, all "
            f"of them on one in {odds['p_all_on_one']:.0%} of draws."
        )
    out["text"] = " ".join(texts)
    return out


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _reuse(r: dict[str, Any]) -> str:
    return f"{_f(r['reuse'], '.1%')} ({_f(r['predicted_reuse'], '.1%')})"


def _split(xs: list[int | None]) -> str:
    return " / ".join(_f(x, ",") for x in xs)


_COLUMNS = (
    "mode",
    "wall s",
    "req/s",
    "x base",
    "p50 / p99 s",
    "requests A / B",
    "evaluated A / B",
    "evaluated",
    "eval x base",
    "reuse (predicted)",
    "of ideal",
    "busy s A / B (use)",
    "other cores",
)


def _table(res: dict[str, Any]) -> Table:
    b = res["batch"]
    t = Table(
        title=f"Two {'vLLM' if res['settings']['engine'] == 'vllm' else 'llama.cpp'} replicas behind triage, "
        "/v1/completions max_tokens=1, concurrency "
        f"{res['settings']['concurrency']} (ideal reuse {b['ideal_reuse']:.1%}, SmolLM2 tokens)",
        title_justify="left",
    )
    for col in _COLUMNS:
        t.add_column(col, justify="left" if col == "mode" else "right")
    for k, rnd in enumerate(res["rounds"]):
        for mode, r in rnd.items():
            label = (
                f"{k + 1}: {mode}"
                + (f" ({r['prefix_affinity_chars']})" if r["prefix_affinity_chars"] else "")
                + (f" ({r['admission']})" if r.get("admission") else "")
            )
            t.add_row(
                label,
                f"{r['wall_s']:.1f}",
                f"{r['rps']:.3f}",
                f"{r['rps_x_baseline']:.2f}",
                f"{r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f}",
                f"{_split(r['requests'])} ({_f(r['busier_share_requests'], '.0%')})",
                _split(r["evaluated_per_server"]),
                _f(r["evaluated_tokens"], ","),
                _f(r["evaluated_x_baseline"], ".3f"),
                _reuse(r),
                _f(r["share_of_ideal"], ".1%"),
                "-"
                if r["busy_s_per_server"] is None
                else f"{r['busy_s_per_server'][0]:.0f} / {r['busy_s_per_server'][1]:.0f} ({r['utilization']:.0%})",
                f"{r['other_cpu_cores']:.2f}",
            )
        t.add_section()
    for mode, r in res["summary"].items():
        t.add_row(
            f"all: {mode}",
            f"{r['wall_s']:.1f}",
            f"{r['rps']:.3f}",
            f"{r['rps_x_baseline']:.2f}",
            f"{r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f}",
            f"busier {r['busier_share_requests_mean']:.0%}",
            "",
            _f(r["evaluated_tokens"], ","),
            _f(r["evaluated_x_baseline"], ".3f"),
            _reuse(r),
            _f(r["share_of_ideal"], ".1%"),
            _f(r["utilization_mean"], ".0%"),
            f"{r['other_cpu_cores_mean']:.2f}",
        )
    return t


def render(console: Console, res: dict[str, Any]) -> None:
    m, b, o = res["machine"], res["batch"], res["split_odds"]
    console.print()
    console.print(
        f"[bold]python -m benchmarks affinity[/]  {m['date']}  {m['platform']}  {m['nproc']} CPUs, load average "
        f"before the run {m['load_avg'][0]}; {b['n']} prompts, {b['templates']} templates, "
        f"{b['prompt_tokens']:,} prompt tokens (longest {b['max_prompt_tokens']}), n_ctx {b['n_ctx']}, "
        f"{res['settings']['n_threads']} thread(s) per server, {len(res['rounds'])} round(s)"
    )
    console.print(
        "[yellow]note:[/] requests A / B from the gateway's triage_upstream_attempts; evaluated from each "
        "server's llama.cpp log; reuse '(predicted)': one-slot caches with the mode's assignment in arrival "
        "order; 'busy': llama.cpp's own time for the requests, 'use' = busy / (2 x wall); 'other cores': CPU "
        "used outside the bench while the mode ran; each round starts cold servers on new ports (a new "
        "affinity split); 'all': requests over summed wall time, tokens summed."
    )
    if res["settings"]["engine"] == "vllm":
        console.print(
            "[yellow]vLLM:[/] evaluated = vLLM's prompt tokens less its prefix-cache hits; no busy time; the "
            "engines start once for the run (the same ports, so the same affinity split every round) and "
            "each mode starts with their prefix caches emptied."
        )
    console.print(_table(res))
    console.print(
        f"split odds over {o['draws']} random replica address pairs ({o['keys']} affinity keys): busier "
        f"replica {o['busier_share_requests_mean']:.0%} of requests and {o['busier_share_tokens_mean']:.0%} "
        f"of prompt tokens on average; all on one replica {o['p_all_on_one']:.0%}; over 75% of requests "
        f"on one {o['p_busier_over_75pct_requests']:.0%}"
    )
    console.print(f"[bold]verdict:[/] {res['verdict']['text']}")
