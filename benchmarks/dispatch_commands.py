"""The dispatch benchmarks' commands of ``python -m benchmarks`` (registered there from
:data:`COMMANDS`): prefix-grouped batches, BatchLLM's order, online affinity, the fleet simulator,
the rule on real engines, what a weighted split adds, and what the console's fleet ring adds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer


def prefix(
    data: Annotated[Path | None, typer.Option(help="JSONL.gz of prompts (default: BBH few-shot direct).")] = None,
    limit: Annotated[
        int,
        typer.Option(
            help="Prompts in the batch (after the seeded shuffle); 60 takes ~16 min on two cores, 300 about an hour."
        ),
    ] = 60,
    templates: Annotated[int, typer.Option(help="Only rows of this many templates (0: all).")] = 6,
    seed: Annotated[int, typer.Option(help="Seed of the shuffle (the arrival order).")] = 0,
    min_shared: Annotated[int, typer.Option(help="Tokens a group's members share at least.")] = 16,
    engine: Annotated[
        list[str] | None,
        typer.Option(
            help="server, scorer and/or vllm (default: server and scorer; vllm needs `make vllm`); "
            "none: the scheduler's cost alone."
        ),
    ] = None,
    n_threads: Annotated[int, typer.Option(help="llama.cpp threads of each engine.")] = 1,
    concurrency: Annotated[int, typer.Option(help="Requests in flight to the server.")] = 1,
    vllm_block_size: Annotated[int, typer.Option(help="vLLM's KV block size in tokens.")] = 32,
    vllm_cache_tokens: Annotated[
        int, typer.Option(help="vLLM's KV cache in tokens (0: its own, 1 GiB, which holds every template of a batch)")
    ] = 0,
    group_by: Annotated[
        str,
        typer.Option(
            help="Tokens the grouping uses: model (SmolLM2's, each prompt whole), "
            "cached (the same, shared prefixes once) or approx."
        ),
    ] = "model",
    repeats: Annotated[int, typer.Option(help="Runs of the scheduler timing (median).")] = 5,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-prefix.json"),
) -> None:
    """Prefix-sorted dispatch: arrival vs sorted vs grouped order, llama.cpp server and local scorer."""
    from benchmarks.prefix_bench import DATA, ENGINES, run

    run(
        data=data or DATA,
        limit=limit,
        templates=templates,
        seed=seed,
        min_shared=min_shared,
        engines=() if engine == ["none"] else tuple(engine or ENGINES),
        n_threads=n_threads,
        concurrency=concurrency,
        group_by=group_by,
        repeats=repeats,
        vllm_block_size=vllm_block_size,
        vllm_cache_tokens=vllm_cache_tokens,
        out=out,
    )


def order(
    data: Annotated[Path | None, typer.Option(help="JSONL.gz of prompts (default: BBH few-shot direct).")] = None,
    limit: Annotated[int, typer.Option(help="Requests in the batch (after the seeded shuffle).")] = 40,
    templates: Annotated[int, typer.Option(help="Only rows of this many templates (0: all).")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the shuffle and of the max_tokens draw.")] = 0,
    decode: Annotated[
        list[int] | None, typer.Option(help="max_tokens values drawn per request (repeat; default 1 and 48).")
    ] = None,
    concurrency: Annotated[int, typer.Option(help="batches.concurrency.")] = 2,
    n_threads: Annotated[int, typer.Option(help="llama.cpp threads of each server.")] = 1,
    rounds: Annotated[int, typer.Option(help="Rounds of both orders, each on fresh servers.")] = 2,
    engine: Annotated[str, typer.Option(help="llama or vllm (two vLLM engines; `make vllm` builds them).")] = "llama",
    slots: Annotated[int, typer.Option(help="Admission slots per replica (llama.cpp's server has one).")] = 1,
    vllm_cache_tokens: Annotated[int, typer.Option(help="Each vLLM engine's KV cache in tokens (0: 1 GiB).")] = 0,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-order.json"),
) -> None:
    """BatchLLM's decode-first order against token order: one batch through the Batch API, two llama.cpp replicas."""
    from benchmarks.order import run
    from benchmarks.prefix_bench import DATA

    run(
        data=data or DATA,
        limit=limit,
        templates=templates,
        seed=seed,
        decode=tuple(decode or (1, 48)),
        concurrency=concurrency,
        n_threads=n_threads,
        rounds=rounds,
        engine=engine,
        slots=slots,
        vllm_cache_tokens=vllm_cache_tokens,
        out=out,
    )


def affinity(
    data: Annotated[Path | None, typer.Option(help="JSONL.gz of prompts (default: BBH few-shot direct).")] = None,
    limit: Annotated[
        int,
        typer.Option(help="Prompts sent (after the seeded shuffle); 48 in 3 rounds take about 12 min on two cores."),
    ] = 48,
    templates: Annotated[int, typer.Option(help="Only rows of this many templates (0: all).")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the shuffle (the arrival order).")] = 0,
    concurrency: Annotated[int, typer.Option(help="Requests in flight through the gateway.")] = 2,
    chars: Annotated[int, typer.Option(help="prefix_affinity_chars of the affinity run.")] = 200,
    admission: Annotated[
        str, typer.Option(help="The admission run's settings, a YAML flow mapping.")
    ] = "slots: 1, max_skips: 8, window_ms: 0",
    mode: Annotated[
        list[str] | None, typer.Option(help="Modes to run (repeat; default all): round_robin, affinity, admission.")
    ] = None,
    n_threads: Annotated[int, typer.Option(help="llama.cpp threads of each server.")] = 1,
    rounds: Annotated[
        int, typer.Option(help="Rounds of every mode, each on fresh servers (a new affinity split).")
    ] = 3,
    engine: Annotated[
        str, typer.Option(help="llama (llama.cpp servers) or vllm (two vLLM engines; `make vllm` builds them).")
    ] = "llama",
    vllm_block_size: Annotated[int, typer.Option(help="vLLM's KV block size in tokens.")] = 32,
    vllm_cache_tokens: Annotated[int, typer.Option(help="Each vLLM engine's KV cache in tokens (0: 1 GiB).")] = 0,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-affinity.json"),
) -> None:
    """Online requests by prefix: two llama.cpp (or vLLM) replicas behind triage, round robin vs prefix
    affinity vs the admission window, in one run."""
    from benchmarks.affinity import DATA, MODES, run

    modes = tuple(m for m in MODES if m in set(mode or MODES) | {"round_robin"})
    run(
        data=data or DATA,
        limit=limit,
        templates=templates,
        seed=seed,
        concurrency=concurrency,
        chars=chars,
        admission=admission,
        modes=modes,
        n_threads=n_threads,
        rounds=rounds,
        engine=engine,
        vllm_block_size=vllm_block_size,
        vllm_cache_tokens=vllm_cache_tokens,
        out=out,
    )


def fleet_sim(
    quick: Annotated[bool, typer.Option(help="8 replicas, fewer requests and loads (about a minute).")] = False,
    sweep: Annotated[bool, typer.Option(help="Also sweep the prefix rule's balance and slack.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the workloads' draws.")] = 0,
    workers: Annotated[int, typer.Option(min=1, help="Processes running the simulations.")] = 2,
    out: Annotated[Path, typer.Option(help="JSON report (the plot beside it, .png).")] = Path("out/fleet-sim.json"),
) -> None:
    """Dispatch rules on a simulated GPU fleet: the gateway's replica set against SGLang- and
    llm-d-style rules, four workloads, TTFT and prefix-cache hit rates."""
    from benchmarks.fleet_report import run

    run(quick=quick, sweep=sweep, seed=seed, workers=workers, out=out)


def fleet_real(
    quick: Annotated[
        bool, typer.Option(help="24 requests per workload and mode (about 7 minutes on two cores; the full run 17).")
    ] = False,
    requests: Annotated[int, typer.Option(help="Requests per workload and mode.")] = 96,
    concurrency: Annotated[int, typer.Option(help="Requests in flight, over both gateways.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Tokens each answer may have (small: prefill dominates).")] = 8,
    templates: Annotated[int, typer.Option(help="BBH few-shot templates of the fewshot workload.")] = 6,
    seed: Annotated[int, typer.Option(help="Seed of the workloads' draws and orders.")] = 0,
    workload: Annotated[
        list[str] | None, typer.Option(help="Workloads (repeat; default all): fewshot, system, distinct.")
    ] = None,
    mode: Annotated[
        list[str] | None,
        typer.Option(help="Modes (repeat; default all): round_robin, least_load, admission, prefix."),
    ] = None,
    cache_tokens: Annotated[int, typer.Option(help="Each vLLM engine's KV cache in tokens.")] = 4096,
    block_tokens: Annotated[int, typer.Option(help="vLLM's KV block (and dispatch.block_tokens).")] = 128,
    admission: Annotated[
        str, typer.Option(help="The admission mode's settings, a YAML flow mapping.")
    ] = "slots: 8, cached_prompts: 16, max_skips: 8, window_ms: 50",
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/fleet-real.json"),
) -> None:
    """The dispatch rule on two real vLLM engines behind two gateways sharing Redis: round robin vs
    least load vs the admission window vs prefix, three workloads, in one run."""
    from benchmarks.fleet_real import MODES, WORKLOADS, run

    run(
        requests=24 if quick else requests,
        concurrency=concurrency,
        max_tokens=max_tokens,
        templates=templates,
        seed=seed,
        workloads=tuple(w for w in WORKLOADS if w in set(workload or WORKLOADS)),
        modes=tuple(m for m in MODES if m in set(mode or MODES) | {"round_robin"}),
        cache_tokens=cache_tokens,
        block_tokens=block_tokens,
        admission=admission,
        out=out,
    )


def split(
    requests: Annotated[int, typer.Option(help="Requests to each of the two rows, alternating.")] = 3000,
    warmup: Annotated[int, typer.Option(help="Requests to each row first, not counted.")] = 300,
) -> None:
    """What a weighted split adds to a request against its model asked by name, in one run."""
    import json

    from benchmarks.split_bench import run

    print(json.dumps(run(requests=requests, warmup=warmup), indent=1))


def recent(
    requests: Annotated[int, typer.Option(help="Requests to each of the two gateways, alternating.")] = 3000,
    warmup: Annotated[int, typer.Option(help="Requests to each gateway first, not counted.")] = 300,
    ring: Annotated[int, typer.Option(help="The fleet's ring's bound (console.recent).")] = 2000,
) -> None:
    """What the fleet's ring of recent requests (Redis) adds to a request, against the same gateway without it."""
    import json

    from benchmarks.recent_bench import run

    print(json.dumps(run(requests=requests, warmup=warmup, recent=ring), indent=1))


COMMANDS: dict[str, Callable[..., Any]] = {
    "prefix": prefix,
    "order": order,
    "affinity": affinity,
    "fleet-sim": fleet_sim,
    "fleet-real": fleet_real,
    "split": split,
    "recent": recent,
}
