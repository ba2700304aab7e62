"""The tables ``python -m benchmarks prefix``'s run prints (``benchmarks/prefix_bench.py``): the
scheduler's cost, each engine's orders, the goals."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.prefix_bench import TOKENS
from benchmarks.report import goals_table


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _scheduler_table(res: dict[str, Any]) -> Table:
    s, n = res["scheduler"], res["batch"]["n"]
    t = Table(
        title=f"Scheduler cost ({n} prompts, median of {res['settings']['repeats']} runs; "
        f"GROUPED uses {s['used']} tokens)",
        title_justify="left",
    )
    for col in (
        "tokens",
        "per prompt",
        "tokenize ms/req",
        "plan ms/req",
        "total ms/req",
        "groups",
        "reuse / ideal",
        "tokens = whole",
        "groups = whole",
    ):
        t.add_column(col, justify="left" if col == "tokens" else "right")
    ideal = res["batch"]["ideal_reuse"]
    labels = {"model": "SmolLM2, whole", "cached": "SmolLM2, cached", "approx": "approx_tokens"}
    for name in TOKENS:
        r = s[name]
        t.add_row(
            labels[name],
            f"{r['tokens_per_prompt']:.0f}",
            f"{r['tokenize_ms_per_req']:.4f}",
            f"{r['plan_ms_per_req']:.4f}",
            f"{r['total_ms_per_req']:.4f}",
            str(r["groups"]),
            _f(r["predicted_reuse"] / ideal if ideal else None, ".2%"),
            f"{r['same_tokens_as_model']:.1%}",
            "yes" if r["same_groups_as_model"] else "no",
        )
    return t


def _orders_table(res: dict[str, Any], name: str) -> Table:
    eng, b = res["engines"][name], res["batch"]
    what = {
        "server": "llama.cpp server, /v1/completions max_tokens=1",
        "scorer": "in-process OptionScorer",
        "vllm": f"vLLM (CPU), /v1/completions max_tokens=1, {res['settings']['concurrency']} in flight, "
        f"{res['settings']['vllm_block_size']}-token blocks, cache "
        + (f"{res['settings']['vllm_cache_tokens']:,} tokens" if res["settings"]["vllm_cache_tokens"] else "1 GiB")
        + "; tokens by vLLM's counters",
    }[name]
    t = Table(title=f"{name}: {what} (ideal reuse {b['ideal_reuse']:.1%})", title_justify="left")
    for col in (
        "order",
        "wall s",
        "req/s",
        "x arrival",
        "prompt tok",
        "evaluated",
        "eval x arrival",
        "predicted reuse",
        "reuse",
        "of ideal",
        "other cores",
    ):
        t.add_column(col, justify="left" if col == "order" else "right")
    for order, r in eng["orders"].items():
        t.add_row(
            order,
            f"{r['wall_s']:.1f}",
            f"{r['rps']:.2f}",
            f"{r['rps_x_arrival']:.2f}",
            f"{r['prompt_tokens']:,}",
            _f(r["evaluated_tokens"], ","),
            _f(r["evaluated_x_arrival"], ".3f"),
            f"{b['predicted_reuse'][order]:.1%}",
            _f(r["reuse"], ".1%"),
            _f(r["share_of_ideal"], ".1%"),
            f"{r['other_cpu_cores']:.2f}",
        )
    return t


def render(console: Console, res: dict[str, Any]) -> None:
    m, b = res["machine"], res["batch"]
    console.print()
    console.print(
        f"[bold]python -m benchmarks prefix[/]  {m['date']}  {m['platform']}  {m['nproc']} CPUs, load average "
        f"before the run {m['load_avg'][0]}; {b['n']} prompts, {b['templates']} templates, "
        f"{b['prompt_tokens']:,} prompt tokens (longest {b['max_prompt_tokens']}), n_ctx {b['n_ctx']}, "
        f"{res['settings']['n_threads']} engine thread(s)"
    )
    console.print(
        "[yellow]note:[/] every request has max_tokens=1, so every decode is alike and decode_ratio "
        "ordering reduces to smaller prompt work first; 'predicted reuse' is a one-slot cache's reuse "
        "of that order, counted on SmolLM2 tokens; 'other cores': CPU used by processes outside the "
        "bench while the order ran."
    )
    console.print(_scheduler_table(res))
    for name in res["engines"]:
        console.print(_orders_table(res, name))
    console.print(goals_table(res["goals"], "Goals (issue 6; vllm: issue 19)"))
