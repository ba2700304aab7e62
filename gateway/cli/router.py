"""``triage eval --router NAME`` and ``triage calibrate --router NAME --target ...``: the learned
router of a routed virtual model, measured on its labels file's test rows, and its knob fitted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from gateway.cli.policy_arg import load_or_exit
from policies.schema import Policy, RoutedModel

if TYPE_CHECKING:
    from classifiers.training.embedding_cache import EmbeddingCache
    from eval import router_calibrate
    from eval.router_run import RouterRun
    from policies.routed import Target


def _routed(policy: Path, name: str) -> tuple[Policy, RoutedModel]:
    pol = load_or_exit(policy, "classifier", ": a routed model reads the encoder")
    vm = pol.virtual_models.get(name)
    if not isinstance(vm, RoutedModel):
        has = ", ".join(n for n, v in pol.virtual_models.items() if isinstance(v, RoutedModel)) or "none"
        typer.echo(f"{policy}: no routed virtual model '{name}' (has: {has})", err=True)
        raise typer.Exit(2)
    return pol, vm


def _embedder(pol: Policy, threads: int = 2) -> EmbeddingCache:
    from classifiers.artifacts import ExportSettings
    from classifiers.training.embedding_cache import embedding_cache
    from classifiers.training.export import ensure_exported

    assert pol.classifier is not None
    ensure_exported(settings=ExportSettings(layers=pol.classifier.encoder.layers))
    return embedding_cache(pol.classifier, threads, "-labels")


Caps = tuple[int | None, int | None]  # at most this many dev and test rows, a seeded sample (None: all)


def evaluate_router(
    policy: Path,
    name: str,
    out: Path,
    fail_under: str | None,
    plots: bool,
    cv_by: str = "row",
    caps: Caps = (None, None),
) -> None:
    from classifiers.service import data_dir
    from eval import router_run
    from eval.router_plots import curve_plot
    from gateway.cli.probe_reader import ProbeReaders

    console = Console(highlight=False)
    pol, vm = _routed(policy, name)
    assert pol.classifier is not None
    cache = _embedder(pol)
    readers = ProbeReaders(pol, say=console.print)
    try:
        result = router_run.measure(
            pol, name, vm, data_dir(pol.classifier, policy.resolve().parent), cache.embed, cv_by, readers, caps
        )
    finally:
        cache.save()
        readers.close()
    out.mkdir(parents=True, exist_ok=True)
    probe_ms = None
    if result.probe is not None and vm.probe is not None:
        probe_ms = readers.caches[vm.probe.backend].ms_p50(result.labels.texts)
    (out / f"router-{name}.json").write_text(
        json.dumps(router_run.report_doc(result, name, vm, caps, probe_ms), indent=2)
    )
    if plots:
        curve_plot(result.report, out / f"router-{name}.png")
    _print(console, result)
    missed = router_run.missed(result.report, fail_under)
    for line in missed:
        console.print(f"[red]fail-under[/red]: {line}")
    console.print(f"wrote {out / f'router-{name}.json'}" + (f" and {out / f'router-{name}.png'}" if plots else ""))
    if missed:
        raise typer.Exit(1)


def _print(console: Console, result: RouterRun) -> None:
    r = result.report
    console.print(
        f"router {r.name} on {r.rows} test rows ({result.protocol}); learner {result.learner}; "
        f"ECE of P(right) {result.test_ece:.3f}; strongest on dev rows: {r.strongest}"
    )
    if (probe := result.probe) is not None:
        w, b = probe.without, probe.without.best_single_at_cost
        apgr = w.two_model.get("apgr") if w.two_model else None
        console.print(
            f"its probe read {probe.probed_share:.1%} of the rows (margin {probe.margin:g}, "
            f"{probe.cost_per_call:g} a reading, "
            f"counted below); without it: router at the best model's cost {b['router_accuracy_at_best_cost']:.4f}, "
            f"matches it at {b['cost_share_to_match']:.1%} of its cost" + ("" if apgr is None else f", APGR {apgr:.3f}")
        )
    table = Table(title="single models, baselines and the router (test rows)", expand=True)
    for col in ("", "accuracy", "mean cost", "strong share"):
        table.add_column(col)
    for m, p in sorted(r.singles.items(), key=lambda kv: kv[1].cost):
        table.add_row(m, f"{p.accuracy:.4f}", f"{p.cost:.6f}", f"{p.strong_share:.3f}")
    table.add_row(
        "category table (dev)",
        f"{r.category_table.accuracy:.4f}",
        f"{r.category_table.cost:.6f}",
        f"{r.category_table.strong_share:.3f}",
    )
    table.add_row("oracle", f"{r.oracle.accuracy:.4f}", f"{r.oracle.cost:.6f}", f"{r.oracle.strong_share:.3f}")
    console.print(table)
    b = r.best_single_at_cost
    console.print(
        f"best single model {b['best_accuracy']:.4f} at {b['best_cost']:.6f}; router at that cost "
        f"{b['router_accuracy_at_best_cost']:.4f}; router matches it at {b['router_cost_to_match']:.6f} "
        f"({b['cost_share_to_match']:.1%} of its cost)"
    )
    if r.anchored is not None:
        console.print(r.anchored.line())
    if r.two_model:
        fmt = {k: ("-" if v is None else f"{v:.3f}") for k, v in r.two_model.items()}
        console.print(f"strong share for 95% of the strong model {fmt['share_for_95pct_of_strong']}")


def calibrate_router(
    policy: Path,
    name: str,
    target: str,
    patch: Path,
    guarantee: float | None = None,
    probe_share: float | None = None,
    caps: Caps = (None, None),
) -> None:
    """Fit the knob on out-of-fold predictions of dev rows (at most ``caps[0]``, a seeded sample), check
    it on test rows (at most ``caps[1]``), write the patch (:mod:`eval.router_calibrate`).
    With ``guarantee`` (DELTA): the knob is certified by Learn-then-Test (:mod:`eval.router_guarantee`).
    A routed model with a probe is fitted as served (its second head where the first's call is close);
    ``probe_share``: the probe's margin is set too, to read that share of the dev rows."""
    from eval import router_calibrate as rc
    from policies.routed import Target

    console = Console(highlight=False)
    try:
        goal = Target.parse(target)
    except ValueError as exc:
        typer.echo(f"--target {exc}", err=True)
        raise typer.Exit(2) from None
    pol, vm = _routed(policy, name)
    if probe_share is not None and vm.probe is None:  # before any row is read
        typer.echo(f"--probe-share: virtual model '{name}' has no probe", err=True)
        raise typer.Exit(2)
    try:
        p = _predictions(console, policy, pol, name, vm, probe_share, caps)
        knob = rc.fit(p, vm, goal, guarantee)
    except rc.CalibrationError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(exc.code) from None
    certified = ""
    if guarantee is not None and knob.certified is not None:
        certified = rc.certified_line(target, guarantee, knob.certified)
        console.print(certified[2:].rstrip())
    for side, o in (("dev (out of fold)", knob.fitted), ("test", knob.checked)):
        console.print(
            f"{side:>18}: knob {o.knob:.6g}, accuracy {o.accuracy:.4f}, mean cost {o.mean_cost:.6f}, "
            f"strong share {o.strong_share:.3f}"
        )
    console.print(_held(goal, rc.held(goal, knob.checked, p.test.correct[:, p.strongest])))
    patch.parent.mkdir(parents=True, exist_ok=True)
    patch.write_text(rc.patch(name, target, p, knob, certified))
    console.print(f"wrote {patch} (review it, then merge it into {policy} yourself)")


def _predictions(
    console: Console, policy: Path, pol: Policy, name: str, vm: RoutedModel, probe_share: float | None, caps: Caps
) -> router_calibrate.Predictions:
    """The rows' predictions as served, their embeddings read (and cached) by the encoder; where the
    routed model has a probe, its readings too, and where it reads said."""
    from classifiers.service import data_dir
    from eval import router_calibrate as rc
    from gateway.cli.probe_reader import ProbeReaders

    assert pol.classifier is not None
    dev, test = rc.splits(vm, data_dir(pol.classifier, policy.resolve().parent), caps)
    cache = _embedder(pol)
    try:
        x = cache.embed(dev.texts), cache.embed(test.texts)
    finally:
        cache.save()
    p = rc.predict(pol, name, vm, (dev, test), x, lambda: ProbeReaders(pol, say=console.print), probe_share)
    if (probed := p.probe) is not None:
        console.print(
            f"probe {probed.backend}: margin {probed.margin:.6g}, reads {probed.on_dev.mean():.1%} of dev rows "
            f"(out of fold), {probed.on_test.mean():.1%} of test rows"
        )
    return p


def _held(goal: Target, h: router_calibrate.Held) -> str:
    """Whether the target holds on the test rows."""
    sign = ">=" if h.at_least else "<="
    return f"target {goal.kind} {sign} {goal.value:g}: test {h.value:.4g}, {'held' if h.held else 'missed'}"
