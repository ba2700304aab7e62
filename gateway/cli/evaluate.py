"""``triage eval``: the cascade of a policy on labeled typed sets, each tier alone and together."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from gateway.errors import PolicyInvalid
from policies import loader


def evaluate(
    policy: Annotated[Path, typer.Option(help="Policy YAML with a `cascade` section.")],
    data: Annotated[list[Path], typer.Option(help="Typed JSONL files (dev rows fit, test rows report).")],
    out: Annotated[Path, typer.Option(help="Folder for report.json and the tier caches.")] = Path("out/eval"),
    top: Annotated[str | None, typer.Option(help="A recorded model (model_labels) as the last tier.")] = None,
    dev_cap: Annotated[int, typer.Option(help="Dev rows per set (a seeded sample).")] = 300,
    test_cap: Annotated[int, typer.Option(help="Test rows per set (a seeded sample).")] = 300,
    slack: Annotated[float, typer.Option(help="Accuracy a cheaper tier may give up against the last one.")] = 0.0,
    patch: Annotated[Path | None, typer.Option(help="Write the fitted numbers here as a YAML policy patch.")] = None,
    fail_under: Annotated[str | None, typer.Option(
        help="Gates for CI, e.g. accuracy=0.8,ece=0.05 (also apgr, escalation): exit 1 when one is missed.")] = None,
    plots: Annotated[bool, typer.Option(help="Draw curves.png and reliability.png.")] = True,
) -> None:
    """Fit temperatures and thresholds on dev rows, then report each tier and the cascade on test rows."""
    from eval import cascade_eval, gates, report_md, tier_runs
    from eval.tier_outputs import TierCache, typed_rows
    from policies.tiers import EncoderTier, ScorerTier

    console = Console(highlight=False)
    try:
        limits = gates.parse(fail_under or "")
    except ValueError as exc:
        typer.echo(f"--fail-under {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        pol = loader.load(policy)
    except PolicyInvalid as exc:
        for problem in exc.problems:
            typer.echo(problem, err=True)
        raise typer.Exit(2) from None
    if pol.cascade is None:
        typer.echo(f"{policy}: the policy has no `cascade` section", err=True)
        raise typer.Exit(2)
    missing = [str(p) for p in data if not p.is_file()]
    if missing:
        typer.echo(f"no such file: {', '.join(missing)}", err=True)
        raise typer.Exit(2)
    problems: list[str] = []
    dev = [r for p in data for r in typed_rows(p, "dev", dev_cap, problems)]
    test = [r for p in data for r in typed_rows(p, "test", test_cap, problems)]
    problems = list(dict.fromkeys(problems))  # a file's bad lines are met once per split read
    for line in problems:
        console.print(f"[yellow]skipped[/yellow] {line}")
    if not test:
        typer.echo("no typed test rows in the given files", err=True)
        raise typer.Exit(2)
    base = policy.resolve().parent
    specs: list[cascade_eval.TierSpec] = []
    live: tier_runs.Live | None = None
    for tier in pol.cascade.tiers:
        if isinstance(tier, EncoderTier):
            compute, fingerprint = tier_runs.encoder(pol, base)
            key = f"encoder-{pol.classifier.encoder.precision}-{fingerprint}"  # type: ignore[union-attr]
        elif isinstance(tier, ScorerTier):
            b = pol.backends[tier.backend]
            model = b.gguf.package or Path(b.gguf.path or "").name  # type: ignore[union-attr]
            compute, key = tier_runs.scorer(pol, tier), f"scorer-{model}-t{tier.templates.version}-{tier.length_norm}"
        else:
            live = live or tier_runs.Live(pol, base)
            compute, key = live.compute(tier), f"model-{tier.model}-{pol.upstream_name(tier.model)}"
        cache = TierCache(out / "cache" / f"{key}.jsonl")
        specs.append(cascade_eval.TierSpec(tier.name, tier.type, _fill(console, cache, dev + test, compute, tier.name)))
    if live is not None:
        live.close()
    if top is not None:
        data_dir = data[0].resolve().parents[1]
        by_source = tier_runs.recorded(data_dir, top)
        outputs = {r.id: by_source[r.source](r) for r in dev + test if r.source in by_source}
        specs.append(cascade_eval.TierSpec(top, "recorded", outputs))
    for spec in specs:
        if spec.kind != "recorded":  # a recorded answer carries no probabilities to calibrate
            cascade_eval.fit_temperatures(spec, dev)
    cascade_eval.fit_thresholds(specs, dev, slack)
    reports = cascade_eval.evaluate(specs, test)
    _print(console, specs, reports)
    out.mkdir(parents=True, exist_ok=True)
    doc: object = {"version": 1, "policy": str(policy), "data": [str(p) for p in data], "top": top,
           "dev_cap": dev_cap, "test_cap": test_cap, "slack": slack, "skipped_lines": problems,
           "tiers": [{"name": s.name, "kind": s.kind, "temperature": s.temperatures, "thresholds": s.thresholds}
                     for s in specs],
           "sets": [asdict(r) for r in reports]}
    doc = _clean(doc)
    (out / "report.json").write_text(json.dumps(doc, indent=2, allow_nan=False))
    (out / "report.md").write_text(report_md.render(doc))  # type: ignore[arg-type]
    if plots:
        from eval import plots as draw

        draw.curves(reports, out / "curves.png")
        draw.reliability(specs, test, out / "reliability.png")
    console.print(f"wrote {out / 'report.json'}, report.md" + (", curves.png, reliability.png" if plots else ""))
    if patch is not None:
        patch.write_text(policy_patch(policy, specs, reports, len(dev)))
        console.print(f"wrote {patch} (review it, then merge it into {policy} yourself)")
    missed = gates.failures(reports, limits)
    for line in missed:
        console.print(f"[red]fail-under[/red]: {line}")
    if missed:
        raise typer.Exit(1)


def policy_patch(policy: Path, specs: list, reports: list, dev_rows: int) -> str:
    """The fitted temperatures and thresholds of the policy's own tiers, as a YAML fragment with
    what they achieved on the test rows as comments. The policy file itself is never edited."""
    lines = [f"# triage eval --patch: fitted on {dev_rows} dev rows of the data given; merge into {policy.name}",
             "# by hand (tiers are matched by name). Test rows, per set: cascade accuracy, share past the first tier"]
    lines += [f"#   {r.source} ({r.qtype}, n={r.n}): accuracy {r.cascade:.3f}, past first {r.past_first:.0%}"
              for r in reports]
    lines += ["cascade:", "  tiers:"]
    for s in specs:
        if s.kind == "recorded":
            continue
        lines.append(f"    - name: {s.name}")
        if s.temperatures:
            lines.append("      temperature: {" + ", ".join(f"{k}: {v:g}" for k, v in s.temperatures.items()) + "}")
        if s.thresholds:
            lines.append("      thresholds: {" + ", ".join(f"{k}: {v:g}" for k, v in s.thresholds.items()) + "}")
    return "\n".join(lines) + "\n"


def _clean(x: object) -> object:
    """JSON without NaN: a measure with no rows behind it is null."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _fill(console: Console, cache: object, rows: list, compute: object, name: str) -> dict:
    with Progress(TextColumn(f"{name:>10}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(name, total=len(rows))
        return cache.fill(rows, compute, lambda: bar.advance(task))  # type: ignore[attr-defined]


def _print(console: Console, specs: list, reports: list) -> None:
    for s in specs:
        console.print(f"{s.name}: temperature {s.temperatures} thresholds {s.thresholds}")
    table = Table(title="test rows: accuracy of each tier alone, of the cascade, and who answered")
    for col in ("set", "type", "n", "tiers alone", "cascade", "answered by", "past first", "ECE", "ms/question"):
        table.add_column(col)
    for r in reports:
        alone = " / ".join(f"{t} {r.alone[t]:.3f}" for t in r.tiers if not math.isnan(r.alone[t]))
        share = " / ".join(f"{t} {r.share[t]:.0%}" for t in r.tiers)
        calib = " / ".join(f"{r.ece[t]:.3f}" for t in r.tiers if not math.isnan(r.ece[t]))
        ms = " / ".join(f"{r.latency_ms[t]:.0f}" for t in r.tiers)
        table.add_row(r.source, r.qtype, str(r.n), alone, f"{r.cascade:.3f}", share, f"{r.past_first:.0%}", calib, ms)
    console.print(table)
