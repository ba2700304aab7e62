"""``triage calibrate --router NAME --target ...``: a routed model's knob fitted on out-of-fold
predictions of its dev rows and checked on its test rows; with a probe, fitted as served (the
probe's head where the first head's call is close), its margin set to read a share of the dev rows
if asked; with a guarantee, the knob certified by Learn-then-Test (:mod:`eval.router_guarantee`).

The embeddings and the probe's readings are passed in (:data:`eval.router_run.Embed`, and a
:class:`Readers` the CLI opens), so that what is measured here reads no model of its own."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from classifiers.training.model_labels import LabelSet
from policies.routed import Outcome, Target
from policies.schema import Policy, RoutedModel

Features = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]  # dev, test inputs -> predictions


class Readers(Protocol):
    """A probe backend's readings of prompts, (rows, width), opened on first use (``ProbeReaders``)."""

    def __call__(self, backend: str) -> Callable[[list[str]], np.ndarray]: ...

    def close(self) -> None: ...


class CalibrationError(Exception):
    """The knob cannot be fitted on these rows: the message, and the exit code it asks for."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def splits(vm: RoutedModel, data_dir: Path, caps: tuple[int | None, int | None]) -> tuple[LabelSet, LabelSet]:
    """The labels file's dev and test rows, a seeded sample of at most ``caps`` each (None: all)."""
    from classifiers.training.router_training import labels_for

    labels = labels_for(vm, data_dir)
    dev, test = labels.split("dev").sample(caps[0]), labels.split("test").sample(caps[1])
    if not len(dev) or not len(test):
        raise CalibrationError(f"{vm.labels} has no dev/test split to fit and check a knob on", 2)
    return dev, test


@dataclass
class Probed:
    """Where the probe reads: its margin, the dev and test rows it reads, and the patch's line."""

    backend: str
    margin: float
    on_dev: np.ndarray
    on_test: np.ndarray
    line: str  # the patch's `probe:` line where the margin was set (else empty)


@dataclass
class Predictions:
    """P(right) per row and candidate as served (pruned; probed where the routed model has a probe),
    and each row's expected cost per candidate (the probe's readings included where it reads)."""

    dev: LabelSet
    test: LabelSet
    q_dev: np.ndarray
    q_test: np.ndarray
    c_dev: np.ndarray
    c_test: np.ndarray
    probe: Probed | None = None

    @property
    def strongest(self) -> int:
        """The candidate right most often on the dev rows."""
        return int(np.nanmean(self.dev.correct, axis=0).argmax())


def predict(
    pol: Policy,
    name: str,
    vm: RoutedModel,
    rows: tuple[LabelSet, LabelSet],
    x: tuple[np.ndarray, np.ndarray],
    readers: Callable[[], Readers] | None = None,
    probe_share: float | None = None,
) -> Predictions:
    """Dev rows out of fold (the knob is fitted on predictions of rows their head never saw) and
    test rows by the head fitted on every dev row; ``x``: their embeddings."""
    from classifiers.training.model_labels import folds
    from classifiers.training.router_training import fit_router
    from eval.router_run import FOLDS, input_tokens, out_of_fold
    from policies.routed import candidate_costs, prune

    dev, test = rows
    c_dev = candidate_costs(pol, vm, input_tokens(dev.texts))
    c_test = candidate_costs(pol, vm, input_tokens(test.texts))

    def predictions(x_d: np.ndarray, x_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        whole = fit_router(pol, name, vm, dev, x_d)
        # the folds refit the learner the whole head chose (a blend: its two parts, and their blend)
        chosen = [str(whole.head.meta["learner"])]
        if chosen == ["blend"]:
            chosen = [part.split()[0] for part in str(whole.head.meta["setting"]).split(" + ")]
        _, q_d, _ = out_of_fold(name, vm, dev, x_d, c_dev, folds(dev.ids, FOLDS), chosen)
        q_t = prune(whole.head.proba(x_t), c_test, whole.head.dev_accuracy if vm.prune_dominated else None)
        return q_d, q_t

    q_dev, q_test = predictions(*x)
    if vm.probe is None or readers is None:
        return Predictions(dev, test, q_dev, q_test, c_dev, c_test)
    probed, q_dev, q_test = _probed(
        vm, (dev.texts, test.texts), (q_dev, q_test), predictions, x, readers(), probe_share
    )
    # the readings' cost, where the probe reads, is the router's: in the costs fitted and checked
    c_dev = c_dev + (probed.on_dev * vm.probe.cost_per_call)[:, None]
    c_test = c_test + (probed.on_test * vm.probe.cost_per_call)[:, None]
    return Predictions(dev, test, q_dev, q_test, c_dev, c_test, probed)


def _probed(
    vm: RoutedModel,
    texts: tuple[list[str], list[str]],
    q: tuple[np.ndarray, np.ndarray],
    predictions: Features,
    x: tuple[np.ndarray, np.ndarray],
    readers: Readers,
    probe_share: float | None,
) -> tuple[Probed, np.ndarray, np.ndarray]:
    """The predictions as a probed router serves them: the probe's head where the first head's two best
    are within the margin (the policy's, or the one that reads ``probe_share`` of the dev rows out of
    fold); which dev and test rows it reads; and the patch's line for the margin, if it was set."""
    from classifiers.quality import joint_features, read_rows
    from policies.routed import close_rows, top_gap

    assert vm.probe is not None
    try:
        read = readers(vm.probe.backend)
        h_dev, h_test = read(texts[0]), read(texts[1])
    finally:
        readers.close()
    p_dev, p_test = predictions(joint_features(x[0], h_dev), joint_features(x[1], h_test))
    q_dev, q_test = q
    # a row the probe cannot read (read as zeros) is not probed, as served
    gap_dev = np.where(read_rows(h_dev), top_gap(q_dev), np.inf)
    margin = vm.probe.margin if probe_share is None else min(1.0, float(np.quantile(gap_dev, probe_share)))
    on_dev = close_rows(q_dev, margin) & read_rows(h_dev)
    on_test = close_rows(q_test, margin) & read_rows(h_test)
    line = (
        ""
        if probe_share is None
        else f"    probe: {json.dumps(vm.probe.model_copy(update={'margin': round(margin, 6)}).model_dump())}\n"
    )
    probed = Probed(vm.probe.backend, margin, on_dev, on_test, line)
    return probed, np.where(on_dev[:, None], p_dev, q_dev), np.where(on_test[:, None], p_test, q_test)


@dataclass
class Knob:
    """The knob fitted (its outcome on the dev rows, out of fold), checked on the test rows; with a
    guarantee, what certified it (rows, knobs tested)."""

    fitted: Outcome
    checked: Outcome
    certified: tuple[int, int] | None = None


def fit(p: Predictions, vm: RoutedModel, goal: Target, guarantee: float | None = None) -> Knob:
    """The knob for ``goal`` (certified with probability at least ``1 - guarantee`` where given)."""
    from policies.routed import fit_knob, outcome

    strongest, certified = p.strongest, None
    if guarantee is not None:
        from eval.router_guarantee import certify_knob

        cert = certify_knob(p.q_dev, p.c_dev, vm.rule, goal, strongest, p.dev.correct, guarantee)
        if cert.knob is None:
            raise CalibrationError(
                f"--guarantee {guarantee:g}: refused. Not even the safest knob is certified on {cert.rows} dev rows "
                f"(p-value {cert.p_values[0][1]:.3g} > {guarantee:g}): more dev rows, or a looser target. "
                "No patch written."
            )
        fitted = outcome(p.q_dev, p.c_dev, vm.rule, cert.knob, strongest, p.dev.correct)
        certified = (cert.rows, cert.tested)
    else:
        try:
            fitted = fit_knob(p.q_dev, p.c_dev, vm.rule, goal, strongest, p.dev.correct)
        except ValueError as exc:
            raise CalibrationError(str(exc)) from None
    checked = outcome(p.q_test, p.c_test, vm.rule, fitted.knob, strongest, p.test.correct)
    return Knob(fitted, checked, certified)


@dataclass(frozen=True)
class Held:
    """The target on the test rows: the measure it names, and whether it holds."""

    value: float
    at_least: bool  # the target is a floor (quality, of_strong), else a ceiling
    held: bool


def held(goal: Target, o: Outcome, strong_right: np.ndarray) -> Held:
    if goal.kind == "of_strong":
        strong = float(np.nan_to_num(strong_right, nan=0.0).mean())
        value = o.accuracy / strong if strong > 0 else float("nan")
    else:
        value = {"quality": o.accuracy, "strong_share": o.strong_share, "cost": o.mean_cost}[goal.kind]
    at_least = goal.kind in ("quality", "of_strong")
    return Held(value, at_least, value >= goal.value if at_least else value <= goal.value)


def certified_line(target: str, guarantee: float, certified: tuple[int, int]) -> str:
    """The patch's comment line for a certified knob."""
    rows, tested = certified
    return (
        f"# guarantee: {target} on new traffic like the {rows} dev rows with probability >= "
        f"{1 - guarantee:g} (Learn-then-Test, fixed sequence, betting p-values, {tested} knobs tested; "
        "out-of-fold predictions, docs/router.md)\n"
    )


def patch(name: str, target: str, p: Predictions, knob: Knob, certified: str) -> str:
    """The YAML patch: the knob (and the probe's margin where it was set), what it did as comments."""
    checked = knob.checked
    return (
        f"# triage calibrate --router {name} --target {target}: fitted on {len(p.dev)} dev rows "
        f"(out of fold), checked on {len(p.test)} test rows: accuracy {checked.accuracy:.4f}, "
        f"mean cost {checked.mean_cost:.6g}, strong share {checked.strong_share:.3f}\n"
        f"{certified}"
        f"virtual_models:\n  {name}:\n    knob: {knob.fitted.knob:.6g}\n{p.probe.line if p.probe else ''}"
    )
