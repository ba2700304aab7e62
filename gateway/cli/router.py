"""``triage eval --router NAME`` and ``triage calibrate --router NAME --target ...``: the learned
router of a routed virtual model, measured on its labels file's test rows, and its knob fitted."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from gateway.cli.policy_arg import load_or_exit
from policies.schema import Policy, RoutedModel

if TYPE_CHECKING:
    from classifiers.training.train_all import EmbeddingCache
    from eval.router_run import RouterRun
    from policies.routed import Outcome, Target


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
    from classifiers.training.export import ensure_exported
    from classifiers.training.train_all import embedding_cache

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
    r = result.report
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "virtual_model": name,
        "labels": vm.labels,
        "protocol": result.protocol,
        "caps": {"dev": caps[0], "test": caps[1]},  # a seeded sample of at most so many rows (None: all)
        "learner": result.learner,
        "test_ece": result.test_ece,
        **asdict(r),
    }
    if result.probe is not None and vm.probe is not None:
        ms = readers.caches[vm.probe.backend].ms_p50(result.labels.texts)
        doc["probe"] = {**asdict(result.probe), "reading_ms_p50": ms}
    (out / f"router-{name}.json").write_text(json.dumps(doc, indent=2))
    if plots:
        curve_plot(r, out / f"router-{name}.png")
    _print(console, result)
    limits = _gates(fail_under)
    missed = [
        f"{k} {v:.3f} < {limits[k]}"
        for k, v in r.two_model.items()
        if k in limits and isinstance(v, float) and v < limits[k]
    ]
    for line in missed:
        console.print(f"[red]fail-under[/red]: {line}")
    console.print(f"wrote {out / f'router-{name}.json'}" + (f" and {out / f'router-{name}.png'}" if plots else ""))
    if missed:
        raise typer.Exit(1)


def _gates(spec: str | None) -> dict[str, float]:
    out = {}
    for part in filter(None, (spec or "").split(",")):
        key, _, value = part.partition("=")
        out[key.strip()] = float(value)
    return out


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
    if r.two_model:
        t = r.two_model
        fmt = {k: ("-" if v is None else f"{v:.3f}") for k, v in t.items()}
        console.print(
            f"RouteLLM measures: APGR {fmt['apgr']}, CPT(50%) {fmt['cpt_50']}, CPT(80%) {fmt['cpt_80']}, "
            f"strong share for 95% of the strong model {fmt['share_for_95pct_of_strong']}"
        )


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
    it on test rows (at most ``caps[1]``), write the patch.
    With ``guarantee`` (DELTA): the knob is certified by Learn-then-Test (:mod:`eval.router_guarantee`).
    A routed model with a probe is fitted as served (its second head where the first's call is close);
    ``probe_share``: the probe's margin is set too, to read that share of the dev rows."""
    from classifiers.service import data_dir
    from classifiers.training.model_labels import folds
    from classifiers.training.router_training import fit_router, labels_for
    from eval.router_run import FOLDS, input_tokens, out_of_fold
    from policies.routed import Target, candidate_costs, fit_knob, outcome, prune

    console = Console(highlight=False)
    try:
        goal = Target.parse(target)
    except ValueError as exc:
        typer.echo(f"--target {exc}", err=True)
        raise typer.Exit(2) from None
    pol, vm = _routed(policy, name)
    assert pol.classifier is not None
    if probe_share is not None and vm.probe is None:  # before any row is read
        typer.echo(f"--probe-share: virtual model '{name}' has no probe", err=True)
        raise typer.Exit(2)
    labels = labels_for(vm, data_dir(pol.classifier, policy.resolve().parent))
    dev, test = labels.split("dev").sample(caps[0]), labels.split("test").sample(caps[1])
    if not len(dev) or not len(test):
        typer.echo(f"{vm.labels} has no dev/test split to fit and check a knob on", err=True)
        raise typer.Exit(2)
    cache = _embedder(pol)
    try:
        x_dev, x_test = cache.embed(dev.texts), cache.embed(test.texts)
    finally:
        cache.save()
    c_dev = candidate_costs(pol, vm, input_tokens(dev.texts))
    c_test = candidate_costs(pol, vm, input_tokens(test.texts))

    def predictions(x_d: np.ndarray, x_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Dev rows out of fold (the knob is fitted on predictions of rows their head never saw) and test
        rows by the head fitted on every dev row, each pruned as served."""
        whole = fit_router(pol, name, vm, dev, x_d)
        # the folds refit the learner the whole head chose (a blend: its two parts, and their blend)
        chosen = [str(whole.head.meta["learner"])]
        if chosen == ["blend"]:
            chosen = [part.split()[0] for part in str(whole.head.meta["setting"]).split(" + ")]
        _, q_d, _ = out_of_fold(name, vm, dev, x_d, c_dev, folds(dev.ids, FOLDS), chosen)
        q_t = prune(whole.head.proba(x_t), c_test, whole.head.dev_accuracy if vm.prune_dominated else None)
        return q_d, q_t

    q_dev, q_test = predictions(x_dev, x_test)
    probe_line = ""
    if vm.probe is not None:
        q_dev, q_test, on_dev, on_test, probe_line = _probed(
            console, pol, vm, dev.texts, test.texts, q_dev, q_test, predictions, x_dev, x_test, probe_share
        )
        # the readings' cost, where the probe reads, is the router's: in the costs fitted and checked
        c_dev = c_dev + (on_dev * vm.probe.cost_per_call)[:, None]
        c_test = c_test + (on_test * vm.probe.cost_per_call)[:, None]
    strongest = int(np.nanmean(dev.correct, axis=0).argmax())
    certified = ""
    if guarantee is not None:
        from eval.router_guarantee import certify_knob

        cert = certify_knob(q_dev, c_dev, vm.rule, goal, strongest, dev.correct, guarantee)
        if cert.knob is None:
            typer.echo(
                f"--guarantee {guarantee:g}: refused. Not even the safest knob is certified on {cert.rows} dev rows "
                f"(p-value {cert.p_values[0][1]:.3g} > {guarantee:g}): more dev rows, or a looser target. "
                "No patch written.",
                err=True,
            )
            raise typer.Exit(1)
        fitted = outcome(q_dev, c_dev, vm.rule, cert.knob, strongest, dev.correct)
        certified = (
            f"# guarantee: {target} on new traffic like the {cert.rows} dev rows with probability >= "
            f"{1 - guarantee:g} (Learn-then-Test, fixed sequence, betting p-values, {cert.tested} knobs tested; "
            "out-of-fold predictions, docs/router.md)\n"
        )
        console.print(certified[2:].rstrip())
    else:
        try:
            fitted = fit_knob(q_dev, c_dev, vm.rule, goal, strongest, dev.correct)
        except ValueError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(1) from None
    checked = outcome(q_test, c_test, vm.rule, fitted.knob, strongest, test.correct)
    for side, o in (("dev (out of fold)", fitted), ("test", checked)):
        console.print(
            f"{side:>18}: knob {o.knob:.6g}, accuracy {o.accuracy:.4f}, mean cost {o.mean_cost:.6f}, "
            f"strong share {o.strong_share:.3f}"
        )
    console.print(_held(goal, checked, test.correct[:, strongest]))
    patch.parent.mkdir(parents=True, exist_ok=True)
    patch.write_text(
        f"# triage calibrate --router {name} --target {target}: fitted on {len(dev)} dev rows "
        f"(out of fold), checked on {len(test)} test rows: accuracy {checked.accuracy:.4f}, "
        f"mean cost {checked.mean_cost:.6g}, strong share {checked.strong_share:.3f}\n"
        f"{certified}"
        f"virtual_models:\n  {name}:\n    knob: {fitted.knob:.6g}\n{probe_line}"
    )
    console.print(f"wrote {patch} (review it, then merge it into {policy} yourself)")


def _probed(
    console: Console,
    pol: Policy,
    vm: RoutedModel,
    dev_texts: list[str],
    test_texts: list[str],
    q_dev: np.ndarray,
    q_test: np.ndarray,
    predictions: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    x_dev: np.ndarray,
    x_test: np.ndarray,
    probe_share: float | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """The predictions as a probed router serves them: the probe's head where the first head's two best
    are within the margin (the policy's, or the one that reads ``probe_share`` of the dev rows out of
    fold); which dev and test rows it reads; and the patch's line for the margin, if it was set."""
    from classifiers.quality import joint_features, read_rows
    from gateway.cli.probe_reader import ProbeReaders
    from policies.routed import close_rows, top_gap

    assert vm.probe is not None
    readers = ProbeReaders(pol, say=console.print)
    try:
        read = readers(vm.probe.backend)
        h_dev, h_test = read(dev_texts), read(test_texts)
    finally:
        readers.close()
    p_dev, p_test = predictions(joint_features(x_dev, h_dev), joint_features(x_test, h_test))
    # a row the probe cannot read (read as zeros) is not probed, as served
    gap_dev = np.where(read_rows(h_dev), top_gap(q_dev), np.inf)
    margin = vm.probe.margin if probe_share is None else min(1.0, float(np.quantile(gap_dev, probe_share)))
    on_dev = close_rows(q_dev, margin) & read_rows(h_dev)
    on_test = close_rows(q_test, margin) & read_rows(h_test)
    console.print(
        f"probe {vm.probe.backend}: margin {margin:.6g}, reads {on_dev.mean():.1%} of dev rows (out of fold), "
        f"{on_test.mean():.1%} of test rows"
    )
    gated_dev = np.where(on_dev[:, None], p_dev, q_dev)
    gated_test = np.where(on_test[:, None], p_test, q_test)
    line = (
        ""
        if probe_share is None
        else f"    probe: {json.dumps(vm.probe.model_copy(update={'margin': round(margin, 6)}).model_dump())}\n"
    )
    return gated_dev, gated_test, on_dev, on_test, line


def _held(goal: Target, o: Outcome, strong_right: np.ndarray) -> str:
    """Whether the target holds on the test rows."""
    if goal.kind == "of_strong":
        strong = float(np.nan_to_num(strong_right, nan=0.0).mean())
        value = o.accuracy / strong if strong > 0 else float("nan")
    else:
        value = {"quality": o.accuracy, "strong_share": o.strong_share, "cost": o.mean_cost}[goal.kind]
    at_least = goal.kind in ("quality", "of_strong")
    held = value >= goal.value if at_least else value <= goal.value
    sign = ">=" if at_least else "<="
    return f"target {goal.kind} {sign} {goal.value:g}: test {value:.4g}, {'held' if held else 'missed'}"
