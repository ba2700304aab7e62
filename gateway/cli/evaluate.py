"""``triage eval``: the cascade of a policy on labeled typed sets, each tier alone and together."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from gateway.cli.policy_arg import load_or_exit

if TYPE_CHECKING:  # the eval's modules are imported when a command runs, not with the CLI
    from eval.cascade_eval import TierSpec
    from eval.cascade_report import Goal, Inputs, Measured, TargetCheck
    from eval.cascade_run import Rows
    from eval.guarantee import Certified
    from eval.tier_outputs import Row, TierCache
    from eval.tier_runs import Compute

T = TypeVar("T")

_Policy = Annotated[Path, typer.Option(help="Policy YAML with a `cascade` section.")]
_Data = Annotated[list[Path] | None, typer.Option(help="Typed JSONL files (dev rows fit, test rows report).")]
_Router = Annotated[
    str | None,
    typer.Option(help="A routed virtual model: measure (or calibrate) the learned router on its labels file instead"),
]
_Top = Annotated[
    list[str] | None,
    typer.Option(
        help="A recorded model (model_labels) as the last tier; repeat it for sets that another model covers "
        "(one `top` tier: on each set, the first model given that has answers for it)"
    ),
]
_Tasks = Annotated[
    list[str] | None,
    typer.Option(
        "--task",
        help="A policy task (classifier.tasks): its intent rows as choice questions naming the task, the gold "
        "label and 4 others as options (mixed traffic: give typed sets too)",
    ),
]
_Tiers = Annotated[
    str | None, typer.Option(help="Only these tiers of the policy's cascade, in its order (comma-separated names)")
]
_TopPrice = Annotated[float, typer.Option(help="What one question to the recorded top tier costs.")]
_DevCap = Annotated[
    int | None, typer.Option(help="Dev rows per set, a seeded sample (300; with --router: every row unless given).")
]
_TestCap = Annotated[
    int | None, typer.Option(help="Test rows per set, a seeded sample (300; with --router: every row unless given).")
]
CAP = 300  # dev and test rows per typed set, unless --dev-cap / --test-cap say
_Target = Annotated[
    str | None,
    typer.Option(
        help="accuracy=X (kept answers right X of the time), escalation=X (at most X past the first tier) or "
        "cost=X (best accuracy at a mean cost per question of at most X), of_top=X (the fewest escalated while "
        "keeping X of each set's last tier's accuracy, pooled); default: a cheaper tier keeps "
        "what it answers as well as the last tier. With --router: strong_share=X, cost=X, quality=X or "
        "of_strong=X (a share of the strongest candidate's accuracy)"
    ),
]


def evaluate(
    policy: _Policy,
    data: _Data = None,
    out: Annotated[Path, typer.Option(help="Folder for the report, the plots and the tier caches.")] = Path("out/eval"),
    top: _Top = None,
    top_price: _TopPrice = 0.0,
    dev_cap: _DevCap = None,
    test_cap: _TestCap = None,
    slack: Annotated[float, typer.Option(help="Accuracy a cheaper tier may give up against the last one.")] = 0.0,
    target: _Target = None,
    patch: Annotated[Path | None, typer.Option(help="Write the fitted numbers here as a YAML policy patch.")] = None,
    fail_under: _FailUnder = None,
    plots: Annotated[bool, typer.Option(help="Draw curves.png and reliability.png.")] = True,
    router: _Router = None,
    cv_by: _CvBy = "row",
    tiers: _Tiers = None,
    task: _Tasks = None,
    guarantee: _Guarantee = None,
) -> None:
    """Fit temperatures and thresholds on dev rows, then report each tier and the cascade on test rows.
    With --router: the learned router of a routed model against every single model, random mixtures,
    the category table and the oracle (gates: apgr=X, ...)."""
    from eval import gates
    from eval.cascade_report import GUARANTEED, certified_line, parse_target, policy_patch

    if router is not None:
        from gateway.cli.router import evaluate_router

        if cv_by not in ("row", "category"):
            typer.echo(f"--cv-by is 'row' or 'category', not {cv_by!r}", err=True)
            raise typer.Exit(2)
        return evaluate_router(policy, router, out, fail_under, plots, cv_by, (dev_cap, test_cap))
    data = _need_data(data, task)
    console = Console(highlight=False)
    limits = _parsed(lambda: gates.parse(fail_under or ""), "--fail-under")
    goal = _parsed(lambda: parse_target(target), "--target")
    caps = (CAP if dev_cap is None else dev_cap, CAP if test_cap is None else test_cap)
    run = _prepare(console, policy, data, out, (top or [], top_price), caps, _names(tiers), task or [])
    if guarantee is not None and (goal is None or goal[0] not in GUARANTEED):
        typer.echo("--guarantee needs --target of_top=X, escalation=X or cost=X", err=True)
        raise typer.Exit(2)
    certified, measured = _fit_and_report(console, run, slack, goal, guarantee)
    if certified is not None and certified.refused:
        _refused(certified)
    _write(console, run, measured, certified, plots)
    if patch is not None:
        line = certified_line(goal, certified) if goal is not None and certified is not None else None
        patch.write_text(policy_patch(policy, run.specs, measured.sets, len(run.rows.dev), line))
        console.print(f"wrote {patch} (review it, then merge it into {policy} yourself)")
    missed = gates.failures(measured.sets, limits)
    for line in missed:
        console.print(f"[red]fail-under[/red]: {line}")
    if missed:
        raise typer.Exit(1)


_FailUnder = Annotated[
    str | None,
    typer.Option(help="Gates for CI, e.g. accuracy=0.8,ece=0.05 (also apgr, escalation): exit 1 when one is missed."),
]
_CvBy = Annotated[
    str,
    typer.Option(
        help="With --router, for a labels file without dev and test rows: cross-validation folds by 'row' or "
        "by 'category' (BBH's tasks: no task both fitted and measured)"
    ),
]


_Guarantee = Annotated[
    float | None,
    typer.Option(
        help="With --target of_top=X, escalation=X or cost=X (with --router: any of its targets): certify the "
        "threshold (the knob) by Learn-then-Test so that the target holds on new traffic like the dev rows with "
        "probability at least 1 - DELTA (refused when the rows are too few)",
        min=0.001,
        max=0.5,
    ),
]


def calibrate(
    policy: _Policy,
    data: _Data = None,
    patch: Annotated[Path, typer.Option(help="Where to write the YAML patch.")] = Path("out/calibrate/patch.yaml"),
    target: _Target = None,
    top: _Top = None,
    top_price: _TopPrice = 0.0,
    dev_cap: _DevCap = None,
    test_cap: _TestCap = None,
    router: _Router = None,
    guarantee: _Guarantee = None,
    probe_share: Annotated[
        float | None,
        typer.Option(
            help="--router with a probe: set its margin to read this share of the dev rows (out of fold)",
            min=0.0,
            max=1.0,
        ),
    ] = None,
) -> None:
    """Fit each tier's temperatures and thresholds on dev rows, check them on test rows, and write a
    reviewable YAML patch (the policy file is never edited). With --router: the routed model's knob
    (and with --probe-share, its probe's margin).
    With --guarantee DELTA: the threshold is certified to meet --target on new traffic with
    probability at least 1 - DELTA (docs/eval.md)."""
    if router is not None:
        from gateway.cli.router import calibrate_router

        if target is None:
            typer.echo("--router needs --target strong_share=X, cost=X, quality=X or of_strong=X", err=True)
            raise typer.Exit(2)
        return calibrate_router(policy, router, target, patch, guarantee, probe_share, (dev_cap, test_cap))
    if probe_share is not None:
        typer.echo("--probe-share sets a routed model's probe margin: it needs --router NAME", err=True)
        raise typer.Exit(2)
    if guarantee is not None and (target is None or target.split("=")[0] not in ("of_top", "escalation", "cost")):
        typer.echo("--guarantee needs --target of_top=X, escalation=X or cost=X", err=True)
        raise typer.Exit(2)
    evaluate(
        policy,
        data,
        patch.parent,
        top,
        top_price,
        dev_cap,
        test_cap,
        0.0,
        target,
        patch,
        None,
        False,
        guarantee=guarantee,
    )


def _names(tiers: str | None) -> list[str] | None:
    return [t.strip() for t in tiers.split(",") if t.strip()] if tiers else None


def _need_data(data: list[Path] | None, tasks: list[str] | None = None) -> list[Path]:
    if not data and not tasks:
        typer.echo("--data: give at least one typed JSONL file (or --router NAME)", err=True)
        raise typer.Exit(2)
    return data or []


def _parsed(fn: Callable[[], T], flag: str) -> T:
    try:
        return fn()
    except ValueError as exc:
        typer.echo(f"{flag} {exc}", err=True)
        raise typer.Exit(2) from None


@dataclass
class _Run:
    """A prepared run: what it was asked, the rows read and the tiers' answers on them."""

    inputs: Inputs
    out: Path
    rows: Rows
    specs: list[TierSpec]


def _prepare(
    console: Console,
    policy: Path,
    data: list[Path],
    out: Path,
    top: tuple[list[str], float],
    caps: tuple[int, int],
    only: list[str] | None = None,
    tasks: list[str] | None = None,
) -> _Run:
    """The policy loaded, the rows read (skipped lines said), each tier's answers computed or read
    from the cache (a progress bar each), and the recorded top tier after them."""
    from eval.cascade_report import Inputs
    from eval.cascade_run import RunError, Tiers, load_rows, recorded_top
    from gateway.cli.live_tier import Live

    pol = load_or_exit(policy, "cascade")
    try:
        rows = load_rows(pol, policy, data, *caps, tasks or [])
        say_skipped(console, rows)
        if not rows.test and caps[1] > 0:
            raise RunError("no typed test rows in the given files")
        specs = Tiers(pol, policy.resolve().parent, out, only, Bars(console), Live).specs(rows)
    except RunError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(exc.code) from None
    if top[0]:
        specs.append(recorded_top(data, rows, *top))
    return _Run(Inputs(policy, data, top[0], caps, rows.problems), out, rows, specs)


def say_skipped(console: Console, rows: Rows) -> None:
    for line in rows.problems:
        console.print(f"[yellow]skipped[/yellow] {line}")


def _fit_and_report(
    console: Console, run: _Run, slack: float, goal: Goal | None, guarantee: float | None
) -> tuple[Certified | None, Measured]:
    """Fitted on the dev rows (the certificate said), measured on the test rows (the tables
    printed), and whether the target held."""
    from eval import cascade_eval, cascade_report
    from eval.cascade_report import certified_line

    certified = cascade_report.fit(run.specs, run.rows.dev, slack, goal, guarantee)
    if goal is not None and certified is not None:
        console.print(certified_line(goal, certified))
    measured = cascade_report.measure(run.specs, run.rows.test)
    _print(console, run.specs, measured.sets)
    _print_pooled(console, measured.pooled, measured.gates)
    if goal is not None:
        dev = cascade_eval.evaluate(run.specs, run.rows.dev)
        console.print(_target_line(cascade_report.check_target(goal, dev, measured.sets)))
    return certified, measured


def _refused(c: Certified) -> NoReturn:
    typer.echo(
        f"--guarantee {c.delta:g}: refused. Not even the safest threshold is certified on {c.rows} dev rows "
        f"(p-value {c.p_values[0][1]:.3g} > {c.delta:g}): give more dev rows (--dev-cap, more data) or a looser "
        "target. No patch written.",
        err=True,
    )
    raise typer.Exit(1)


def _write(console: Console, run: _Run, measured: Measured, certified: Certified | None, plots: bool) -> None:
    from eval import cascade_report

    doc = cascade_report.report_doc(run.inputs, run.specs, measured, certified)
    cascade_report.write(run.out, doc, measured.sets, run.specs, run.rows.test, plots)
    console.print(f"wrote {run.out / 'report.json'}, report.md" + (", curves.png, reliability.png" if plots else ""))


def _target_line(c: TargetCheck) -> str:
    """Whether the target held on test rows (within 2 points), and by how much it missed if not."""
    kind, x = c.goal
    if kind == "of_top":
        assert c.reached_top is not None
        verdict = "held" if c.held else f"[red]missed by {c.miss * 100:.1f} points[/red]"
        return (
            f"target of_top {x}: dev {c.dev:.3f} ({c.reached_top[0]:.0%} reached the top), "
            f"test {c.test:.3f} ({c.reached_top[1]:.0%}): {verdict}"
        )
    if kind == "cost":  # within 2% of the budget
        verdict = "held" if c.held else f"[red]over budget by {c.miss:.1%}[/red]"
    else:
        verdict = "held" if c.held else f"[red]missed by {c.miss * 100:.1f} points[/red]"
    return f"target {kind} {x}: dev {c.dev:.3f}, test {c.test:.3f}: {verdict}"


class Bars:
    """The run's progress on the console: a bar per tier filled, a spinner while embedding."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def fill(self, cache: TierCache, rows: list[Row], compute: Compute, name: str) -> dict[str, Any]:
        with Progress(
            TextColumn(f"{name:>10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        ) as bar:
            task = bar.add_task(name, total=len(rows))
            return cache.fill(rows, compute, lambda: bar.advance(task))

    def status(self, text: str) -> AbstractContextManager[Any]:
        return self.console.status(text)


_GATE_COLUMNS = ("accuracy", "auroc_raw", "auroc_learned", "ece_learned")


def _print_pooled(console: Console, pooled_by: dict, gate_rows: list) -> None:
    for which, pooled in pooled_by.items():
        if not pooled:
            continue
        console.print(
            f"pooled, {'every set' if which == 'all' else 'typed sets only'} ({pooled['n']:.0f} test rows): cascade "
            f"{pooled['cascade']:.3f} against always-top {pooled['always_top']:.3f} ({pooled['of_top']:.1%}), "
            f"{pooled['reached_top']:.0%} reached the top tier; worst set against its best tier alone: "
            f"{pooled['worst_vs_best_tier'] * 100:+.1f} points"
        )
    table = Table(title="the gates' signals, pooled test rows: right/wrong AUROC and the calibration of P(right)")
    for col in ("tier", "type", "n", "accuracy", "AUROC own confidence", "AUROC learned", "ECE learned"):
        table.add_column(col)
    for g in gate_rows:
        cells = ["-" if k not in g or not math.isfinite(g[k]) else f"{g[k]:.3f}" for k in _GATE_COLUMNS]
        table.add_row(g["tier"], g["type"], f"{g['n']:.0f}", *cells)
    console.print(table)


def _print(console: Console, specs: list, reports: list) -> None:
    for s in specs:
        console.print(f"{s.name}: gate {s.gate_kind}, temperature {s.temperatures} thresholds {s.thresholds}")
        if s.judge_fit:
            fit = {k: v for k, v in s.judge_fit.items() if k != "tried"}
            console.print(f"  confidence model (dev rows, out of fold): {fit}")
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
    for r in reports:
        if r.curve.anchored is not None:
            console.print(f"{r.source} ({r.qtype}): {r.curve.anchored.line()}")
