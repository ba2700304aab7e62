"""``triage bench ...``: benchmarks that print ratios against a baseline run in the same process."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(help="Benchmarks.", no_args_is_help=True)


@app.command("overhead")
def overhead(
    requests: Annotated[int, typer.Option(help="Requests per latency measurement.")] = 2000,
    concurrency: Annotated[int, typer.Option(help="Concurrency of the throughput run.")] = 32,
    duration: Annotated[float, typer.Option(help="Seconds per throughput run.")] = 10.0,
    litellm: Annotated[bool, typer.Option(help="Include the LiteLLM proxy.")] = True,
) -> None:
    """Added latency and throughput: direct vs triage vs LiteLLM proxy, one fast upstream."""
    from eval.bench.overhead import run

    run(requests=requests, concurrency=concurrency, duration=duration, with_litellm=litellm)
