"""The pool benchmark's command of ``python -m benchmarks`` (registered there from :data:`COMMANDS`):
a pool of cheaper models against the best single one (issue 56), :mod:`benchmarks.pool`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer


def pool(
    policy: Annotated[Path, typer.Option(help="The policy with the 29 models' prices.")] = Path(
        "policies/examples/router_mmlu_pro.yaml"
    ),
    router: Annotated[
        str, typer.Option(help="Its routed model (labels: model_labels/mmlu_pro_models).")
    ] = "mmlu-pro-29",
    prior: Annotated[
        list[str] | None,
        typer.Option(
            help="The models' priors: accuracy, category (dev rows), heads (the quality heads) and/or memory "
            "(the nearest dev questions' agreement with the top)."
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-pool.json"),
    data: Annotated[
        str,
        typer.Option(
            "--set",
            help="mmlu-pro (29 models' recorded answers) or routellm-mmlu (GPT-4 and Mixtral: the router alone, "
            "with --policy policies/examples/router.yaml --router gpt4-or-mixtral).",
        ),
    ] = "mmlu-pro",
) -> None:
    """Issue 56: agreement, cascade routing and both against the learned router and the best single
    model, on MMLU-Pro's recorded answers of 29 models (dev rows fit, test rows report)."""
    if data == "routellm-mmlu":
        from benchmarks.pool_routellm import run as run_routellm

        run_routellm(policy, router, out)
        return
    if data != "mmlu-pro":
        raise typer.BadParameter("--set is mmlu-pro or routellm-mmlu")
    from benchmarks.pool import run

    kinds = prior or ["accuracy", "category", "heads", "memory"]
    bad = [k for k in kinds if k not in ("accuracy", "category", "heads", "memory")]
    if bad:
        raise typer.BadParameter(f"--prior is accuracy, category, heads or memory, not {', '.join(bad)}")
    run(policy, router, [k for k in kinds if k != "heads"], out, "heads" in kinds)


def pool_served(
    policy: Annotated[Path, typer.Option(help="The served cascade with agreement.")] = Path(
        "policies/examples/cascade_pool.yaml"
    ),
    fit: Annotated[bool, typer.Option(help="Fit its numbers on dev rows first (and print them).")] = False,
    routing: Annotated[
        bool, typer.Option(help="Also route its tiers (cascade.routing), the agreement and knob fitted on dev rows.")
    ] = False,
    router_policy: Annotated[Path, typer.Option(help="The policy with the 29 models' prices and labels.")] = Path(
        "policies/examples/router_mmlu_pro.yaml"
    ),
    router: Annotated[
        str, typer.Option(help="Its routed model (labels: model_labels/mmlu_pro_models).")
    ] = "mmlu-pro-29",
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-pool-served.json"),
) -> None:
    """Issue 56, served: the example three-tier cascade with agreement, through the gateway's own
    cascade, over MMLU-Pro's recorded answers of its models (test rows; --fit: dev rows first)."""
    from benchmarks.pool_served import run

    run(policy, router_policy, router, fit, routing, out)


def pool_examples(
    rows: Annotated[int, typer.Option(help="Test rows asked (a seeded sample), each twice.")] = 150,
    k: Annotated[int, typer.Option(help="The most examples shown.")] = 3,
    min_similarity: Annotated[float, typer.Option(help="The cosine similarity an example needs.")] = 0.5,
    cascade_policy: Annotated[Path, typer.Option(help="The policy whose scorer tier is asked.")] = Path(
        "policies/examples/cascade.yaml"
    ),
    router_policy: Annotated[Path, typer.Option(help="The policy with MMLU-Pro's labels.")] = Path(
        "policies/examples/router_mmlu_pro.yaml"
    ),
    router: Annotated[str, typer.Option(help="Its routed model.")] = "mmlu-pro-29",
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-pool-examples.json"),
    threads: Annotated[int | None, typer.Option(help="The scorer's threads (default: the policy's).")] = None,
) -> None:
    """Issue 56, escalations that teach: the local scorer on MMLU-Pro test rows with and without the
    nearest dev questions' top answers as solved examples (policies/memory.py)."""
    from benchmarks.pool_examples import run

    run(cascade_policy, router_policy, router, rows, k, min_similarity, out, threads)


def pool_chains(
    cheap: Annotated[int, typer.Option(help="The most accurate cheap models whose orders are tried.")] = 7,
    share: Annotated[float, typer.Option(help="A cheap model's cost at most this share of the strongest's.")] = 0.15,
    policy: Annotated[Path, typer.Option(help="The policy with the 29 models' prices.")] = Path(
        "policies/examples/router_mmlu_pro.yaml"
    ),
    router: Annotated[str, typer.Option(help="Its routed model.")] = "mmlu-pro-29",
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-pool-chains.json"),
) -> None:
    """Issue 56: chains of up to three cheap models before the strongest, with agreement, chosen on dev rows."""
    from benchmarks.pool_chains import run

    run(policy, router, cheap, share, out)


def pool_typed(
    policy: Annotated[Path, typer.Option(help="The cascade policy, its learned gates trained on these sets.")] = Path(
        "policies/examples/cascade.yaml"
    ),
    data: Annotated[Path, typer.Option(help="The shared data folder.")] = Path("../shared/data"),
    cache: Annotated[Path, typer.Option(help="triage eval's --out: the tiers' cached answers.")] = Path("out/eval"),
    dev_cap: Annotated[int, typer.Option(help="Dev rows per set.")] = 100,
    test_cap: Annotated[int, typer.Option(help="Test rows per set.")] = 100,
    own_temper: Annotated[float, typer.Option(help="The scorer's own log-probabilities beside its vote.")] = 1.0,
    out: Annotated[Path, typer.Option(help="JSON report.")] = Path("out/bench-pool-typed.json"),
) -> None:
    """Issue 56: on the typed sets with a recorded top, the scorer -> top step judged by the encoder's and
    the scorer's agreement, against the learned gate and the scorer's own confidence."""
    from benchmarks.pool_typed import run

    run(policy, data, cache, dev_cap, test_cap, own_temper, out)


COMMANDS: dict[str, Callable[..., Any]] = {
    "pool": pool,
    "pool-served": pool_served,
    "pool-examples": pool_examples,
    "pool-chains": pool_chains,
    "pool-typed": pool_typed,
}
