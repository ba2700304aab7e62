"""``triage train --policy P``: export the encoder if needed, train every head the policy declares."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from classifiers.training.router_training import RouterResult
from gateway.cli.policy_arg import load_or_exit
from policies.schema import Policy, RoutedModel

if TYPE_CHECKING:
    from classifiers.training.train_all import TrainReport


def _routers(results: list[RouterResult], console: Console) -> None:
    for r in results:
        table = Table(title=f"router {r.name}: learners tried (held-back dev rows; highest AUROC wins)")
        for col in ("learner", "setting", "log-loss", "AUROC"):
            table.add_column(col)
        for c in r.tried:
            table.add_row(c.learner, c.setting, f"{c.log_loss:.4f}", f"{c.auroc:.3f}")
        console.print(table)
        aurocs = ", ".join(f"{m} {v:.3f}" for m, v in r.test_auroc.items())
        console.print(
            f"router {r.name}: {r.head.meta['learner']} {r.head.meta['setting']} fitted on {r.fit_rows} "
            f"rows ({r.fitted_on}); test rows {r.test_rows}: AUROC {aurocs or 'n/a'}, ECE {r.test_ece:.3f}"
        )
        if (p := r.probe) is not None:
            aurocs = ", ".join(f"{m} {v:.3f}" for m, v in p.test_auroc.items())
            console.print(
                f"router {r.name}, with its probe ({p.head.meta['probe']}): {p.head.meta['learner']} "
                f"{p.head.meta['setting']}; test rows: AUROC {aurocs or 'n/a'}, ECE {p.test_ece:.3f}, "
                f"probed at the policy's margin {p.probed_share:.1%}"
            )


def train(
    policy: Annotated[Path, typer.Option(help="Policy YAML with a `classifier` section.")],
    threads: Annotated[int, typer.Option(help="Encoder threads while training.")] = 2,
    report: Annotated[Path | None, typer.Option(help="Write the measured figures as JSON here.")] = None,
    limit: Annotated[
        int | None,
        typer.Option(help="At most this many rows per head and split (quick runs; the routers' a seeded sample)."),
    ] = None,
    routers_only: Annotated[
        bool, typer.Option("--routers-only", help="Only the routed models' quality heads.")
    ] = False,
    cascade_data: Annotated[
        list[Path] | None,
        typer.Option(help="Typed JSONL for the learned gates (default: every typed set in the data folder)."),
    ] = None,
    cascade_dev_cap: Annotated[int, typer.Option(help="Dev rows per set the learned gates are fitted on.")] = 300,
    cascade_out: Annotated[
        Path, typer.Option(help="Where the tiers' answers are cached (triage eval's --out: shared).")
    ] = Path("out/eval"),
    probe_dir: Annotated[
        Path | None,
        typer.Option(
            "--probes", help="A folder of the guard's probe sets (ood_probe*.jsonl; a checkout's benchmarks/probes)."
        ),
    ] = None,
) -> None:
    """Train the heads on dev rows, calibrate them, measure them on test rows; then the quality
    heads of every routed virtual model (the learned router); then the confidence model of every
    cascade tier with `gate: learned` (it needs the tiers' answers on dev rows: the local models run)."""
    from classifiers.artifacts import ExportSettings
    from classifiers.training.export import ensure_exported
    from classifiers.training.train_all import train as run

    console = Console(highlight=False)
    pol = load_or_exit(policy)
    if pol.classifier is None:
        if _learned(pol):  # a cascade of local models only: its gates read no embedding
            return _gates(console, policy, pol, cascade_data, cascade_dev_cap, cascade_out)
        typer.echo(f"{policy}: the policy has no `classifier` section and no learned gate: nothing to train", err=True)
        raise typer.Exit(2)
    art, built = ensure_exported(settings=ExportSettings(layers=pol.classifier.encoder.layers))
    console.print(f"encoder: {'exported to' if built else 'cached at'} {art.root}")
    if any(isinstance(vm, RoutedModel) for vm in pol.virtual_models.values()):
        _routers(_train_routers(console, policy, pol, threads, limit), console)
    if routers_only:
        return
    result = run(
        pol.classifier, policy.resolve().parent, threads=threads, say=console.print, limit=limit, probe_dir=probe_dir
    )
    _heads(console, result)
    _probes(console, result)
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(asdict(result), indent=2))
    _gates(console, policy, pol, cascade_data, cascade_dev_cap, cascade_out)


def _train_routers(console: Console, policy: Path, pol: Policy, threads: int, limit: int | None) -> list[RouterResult]:
    """Every routed model's quality heads (and its probe's, read by the probe's model)."""
    from classifiers.training.train_all import train_quality
    from gateway.cli.probe_reader import ProbeReaders

    readers = ProbeReaders(pol, say=console.print)
    try:
        return train_quality(
            pol, policy.resolve().parent, threads=threads, say=console.print, hidden=readers, limit=limit
        )
    finally:
        readers.close()


def _heads(console: Console, result: TrainReport) -> None:
    """The heads on their test rows, and per test set where a head has several."""
    table = Table(title=f"heads (test rows), trained in {result.seconds:.0f} s", expand=True)
    for col in ("head", "fit rows", "test rows", "accuracy", "ECE", "ECE (T=1)", "other"):
        table.add_column(col)
    for h in result.heads:
        other = ", ".join(f"{k} {v:.3f}" for k, v in h.extra.items())
        table.add_row(
            h.name,
            str(h.fit_rows),
            str(h.test_rows),
            f"{h.accuracy:.3f}",
            f"{h.ece:.3f}",
            f"{h.ece_uncalibrated:.3f}",
            other,
        )
    console.print(table)
    for h in result.heads:
        if h.by_source:
            per = Table(title=f"{h.name} by test set", expand=True)
            for col in ("set", "rows", "accuracy", "answered"):
                per.add_column(col)
            for name, r in h.by_source.items():
                per.add_row(name, str(r.n), f"{r.accuracy:.3f}", ", ".join(f"{k} {v}" for k, v in r.predicted.items()))
            console.print(per)


_PROBE_COLUMNS = (
    "probes",
    "kind",
    "n",
    "far",
    "language",
    "foreign",
    "router",
    "router (whole only)",
    "guarded",
    "doubtful",
    "guarded or doubtful",
)


def _probes(console: Console, result: TrainReport) -> None:
    """What the guard calls unfamiliar, and how it did on the benign probes."""
    console.print(
        f"unfamiliar: another language than English, max cosine to training rows under "
        f"{result.ood_threshold:.3f}, or foreign word pieces over {result.foreign_threshold:.3f} "
        "of the prompt"
    )
    probes = Table(title="the guard on the probes (benign: every flag is a false one)", expand=True)
    for col in _PROBE_COLUMNS:
        probes.add_column(col)
    for p in result.probes:
        shares = (p.far, p.language, p.foreign, p.router, p.router_whole, p.guarded, p.doubtful, p.no_confident_class)
        probes.add_row(p.probes.removesuffix(".jsonl"), p.kind, str(p.n), *(f"{v:.0%}" for v in shares))
    console.print(probes)


def _learned(pol: Policy) -> bool:
    return pol.cascade is not None and any(t.gate == "learned" for t in pol.cascade.tiers)


def _gates(console: Console, policy: Path, pol: Policy, data: list[Path] | None, dev_cap: int, out: Path) -> None:
    """The learned gates, after the heads they may read (the encoder tier's answers): each tier's
    confidence model fitted on dev rows (:mod:`eval.gate_fit`), saved where the gateway reads it."""
    from classifiers.service import data_dir
    from eval.cascade_run import RunError, load_rows
    from eval.gate_fit import fit_gates
    from gateway.cli.evaluate import Bars, say_skipped
    from gateway.cli.live_tier import Live
    from gateway.service.assemble import judges_dir

    if not _learned(pol):
        return
    if data:
        files = data
    elif pol.classifier is not None:
        files = sorted((data_dir(pol.classifier, policy.resolve().parent) / "typed").glob("*.jsonl*"))
    else:
        typer.echo("the learned gates need labeled rows: give --cascade-data (typed JSONL with dev rows)", err=True)
        raise typer.Exit(2)
    where = judges_dir(pol, policy.resolve().parent)
    if where is None:
        typer.echo(
            "cascade: a tier has `gate: learned` but neither cascade.artifacts nor a classifier says where", err=True
        )
        raise typer.Exit(2)
    try:
        rows = load_rows(pol, policy, files, dev_cap, 0)
        say_skipped(console, rows)
        fitted = fit_gates(pol, policy, rows, out, where, Bars(console), Live)
    except RunError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(exc.code) from None
    for gate in fitted:
        if gate.saved is None:
            typer.echo(f"tier {gate.tier}: no confidence model: {gate.fit.get('error')}", err=True)
            raise typer.Exit(1)
        fit = gate.fit
        console.print(
            f"gate {gate.tier}: {fit['variant']} (C {fit['C']}) on {fit['rows']} dev rows, {fit['right']} right; "
            f"out-of-fold AUROC {fit['dev_auroc']:.3f} against its own confidence's {fit['dev_auroc_raw']:.3f}"
        )
    for gate in fitted:
        console.print(f"wrote {gate.saved}")
