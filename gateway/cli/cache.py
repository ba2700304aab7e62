"""``triage cache fit``: fit the semantic response cache's hit rule to a false-hit budget on the
intent sets' tuning rows (:mod:`eval.cache_fit`), and print the policy's YAML snippet."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gateway.cli.policy_arg import load_or_exit

app = typer.Typer(help="The semantic response cache.", no_args_is_help=True)


@app.command("fit")
def fit(
    policy: Annotated[Path, typer.Option(help="The policy (its classifier.encoder embeds).")],
    budget: Annotated[
        float, typer.Option(min=0.0001, max=0.5, help="The false-hit budget (wrong hits / hits).")
    ] = 0.01,
    kind: Annotated[str, typer.Option(help="The rule's kind: global, margin or vote.")] = "vote",
    confidence: Annotated[
        float, typer.Option(min=0.0, max=0.999, help="The upper bound's confidence (0: the point estimate).")
    ] = 0.95,
    data: Annotated[Path | None, typer.Option(help="The labeled sets (default: the classifier's data).")] = None,
    threads: Annotated[int, typer.Option(help="Encoder threads.")] = 2,
) -> None:
    """Fit the hit rule on the tuning rows (CLINC150 dev, BANKING77 and HWU64 train)."""
    from classifiers.service import data_dir
    from classifiers.training.embedding_cache import embedding_cache
    from eval.cache_fit import KINDS, Replay, streams
    from eval.cache_fit import fit as fit_rule

    if kind not in KINDS:
        typer.echo(f"--kind {kind}: one of {', '.join(KINDS)}", err=True)
        raise typer.Exit(2)
    pol = load_or_exit(policy, "classifier", "the cache's embeddings come from classifier.encoder")
    assert pol.classifier is not None
    root = data or data_dir(pol.classifier, policy.resolve().parent)
    cache = embedding_cache(pol.classifier, threads, "-semcache")
    try:
        tuning = streams(root, cache.embed, "tuning")
    finally:
        cache.save()
    f = fit_rule(kind, [Replay(s) for s in tuning], budget, confidence)
    rule = ", ".join(f"{k}: {v}" for k, v in f.rule.as_dict().items())
    typer.echo(
        f"# tuning rows: {f.tuning.rows}, hit rate {f.tuning.hit_rate:.4f}, false-hit rate "
        f"{f.tuning.false_hit_rate:.4f} (upper bound {f.bound:.4f} at {confidence})"
    )
    typer.echo(f"semantic: {{false_hit_budget: {budget}, rule: {{{rule}}}}}")
