"""The guardrails' commands of ``python -m benchmarks`` (registered there from :data:`COMMANDS`):
their labeled sets rebuilt from the public repositories, and their quality and cost measured."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer


def guardrails(
    threads: Annotated[int, typer.Option(help="Encoder threads.")] = 1,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds of the added-latency run.")] = 6,
    requests: Annotated[int, typer.Option(help="Requests per target and round.")] = 100,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-guardrails.json"),
) -> None:
    """Jailbreak AUROC and TPR at 1% FPR, PII recall and precision, the input guardrails' added p50
    at 32 tokens and the output check's cost per streamed chunk (docs/guardrails.md)."""
    from benchmarks.guardrail_bench import run

    print(json.dumps(run(threads=threads, rounds=rounds, requests=requests, out=out), indent=1))


def guardrail_data(
    mirrors: Annotated[Path, typer.Option(help="A folder of git snapshots: <owner>+<name>/repo.")],
) -> None:
    """Rebuild benchmarks/data/ (the jailbreak sets, the PII set) from the public repositories."""
    from benchmarks.guardrail_data import build

    print(json.dumps(build(mirrors), indent=1))


COMMANDS: dict[str, Callable[..., Any]] = {"guardrails": guardrails, "guardrail-data": guardrail_data}
