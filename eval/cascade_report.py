"""``triage eval``'s fitting and report, on a prepared run (:mod:`eval.cascade_run`): temperatures,
gates and thresholds fitted on dev rows to a target, each tier and the cascade measured on test rows,
the report written (``report.json``, ``report.md``, plots) and the policy patch's text. Pure but for
:func:`write`; the CLI prints what these return."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eval import agreement_fit, cascade_eval, cascade_fit
from eval.cascade_eval import SetReport, TierSpec
from eval.guarantee import Certified
from eval.tier_outputs import Row
from policies.pool import Agreement

Goal = tuple[str, float]  # accuracy | escalation | cost | of_top, and X
GUARANTEED = ("of_top", "escalation", "cost")  # the targets --guarantee certifies


def parse_target(spec: str | None) -> Goal | None:
    """``--target KIND=X``; a ValueError says what a target is."""
    if not spec:
        return None
    key, sep, value = spec.partition("=")
    if not sep or key not in ("accuracy", "escalation", "cost", "of_top"):
        raise ValueError(f"'{spec}': expected accuracy=X, escalation=X, cost=X or of_top=X")
    x = float(value)
    if not 0 <= x <= (float("inf") if key == "cost" else 1):
        raise ValueError(f"'{spec}': X must be within [0, 1]" if key != "cost" else f"'{spec}': a cost is >= 0")
    return key, x


def fit(
    specs: list[TierSpec], dev: list[Row], slack: float, goal: Goal | None, delta: float | None
) -> Certified | None:
    """Temperatures, confidence models and thresholds fitted on ``dev``, in place; with ``delta``
    (``--guarantee``) and a goal, the threshold certified by Learn-then-Test, returned."""
    for spec in specs:
        if spec.kind != "recorded":  # a recorded answer carries no probabilities to calibrate
            cascade_fit.fit_temperatures(spec, dev)
    cascade_eval.fit_judges(specs, dev)
    agreement_fit.fit_agreements(specs, dev)
    if goal is not None and delta is not None:
        return cascade_fit.fit_with_guarantee(specs, dev, goal, delta)
    if goal is not None and goal[0] == "cost":
        cascade_fit.fit_for_cost(specs, dev, goal[1])
    elif goal is not None and goal[0] == "of_top":
        cascade_fit.fit_for_share_of_top(specs, dev, goal[1])
    else:
        cascade_fit.fit_thresholds(specs, dev, slack, goal)
    return None


@dataclass
class Measured:
    """The test rows' report: per set, pooled (every set; and the typed sets alone where task rows
    were given: mixed traffic), and the gates' signals."""

    sets: list[SetReport]
    pooled: dict[str, dict[str, float]] = field(default_factory=dict)
    gates: list[dict[str, Any]] = field(default_factory=list)


def measure(specs: list[TierSpec], test: list[Row]) -> Measured:
    reports = cascade_eval.evaluate(specs, test)
    pooled = {"all": cascade_eval.pooled(reports)}
    if any(r.task for r in reports):
        pooled["typed"] = cascade_eval.pooled([r for r in reports if not r.task])
    return Measured(reports, pooled, cascade_eval.gate_table(specs, test))


@dataclass(frozen=True)
class TargetCheck:
    """Whether the target held on test rows (within 2 points; a cost within 2% of the budget)."""

    goal: Goal
    dev: float
    test: float
    held: bool
    miss: float  # points (a share) under the target; for a cost, the share over the budget
    reached_top: tuple[float, float] | None = None  # of_top: the dev and test rows' share at the top tier


def check_target(goal: Goal, dev: list[SetReport], test: list[SetReport]) -> TargetCheck:
    if goal[0] == "of_top":
        d, t = cascade_eval.pooled(dev), cascade_eval.pooled(test)
        held = t["of_top"] >= goal[1] - 0.02
        return TargetCheck(
            goal, d["of_top"], t["of_top"], held, goal[1] - t["of_top"], (d["reached_top"], t["reached_top"])
        )
    attr = {"accuracy": "cascade", "escalation": "past_first", "cost": "cost_per_question"}[goal[0]]
    on_dev, on_test = _pooled(dev, attr), _pooled(test, attr)
    miss = (goal[1] - on_test) if goal[0] == "accuracy" else (on_test - goal[1])
    if goal[0] == "cost":
        return TargetCheck(goal, on_dev, on_test, miss <= 0.02 * goal[1], miss / goal[1])
    return TargetCheck(goal, on_dev, on_test, miss <= 0.02, miss)


def _pooled(reports: list[SetReport], attr: str) -> float:
    n = sum(r.n for r in reports)
    return sum(getattr(r, attr) * r.n for r in reports if math.isfinite(getattr(r, attr))) / n if n else math.nan


def certified_line(goal: Goal, c: Certified) -> str:
    """What --guarantee certified, in a sentence (the console, the patch and the report say it)."""
    kind, x = goal
    if c.knob is None:
        return f"guarantee: refused ({c.rows} dev rows; the safest threshold's p-value {c.p_values[0][1]:.3g})"
    return (
        f"guarantee: {kind} {'>=' if kind == 'of_top' else '<='} {x:g} on new traffic like the {c.rows} dev rows, "
        f"with probability >= {1 - c.delta:g} (Learn-then-Test, fixed sequence, betting p-values): threshold "
        f"{c.knob:g} for every tier but the last, {c.tested} thresholds tested"
    )


def certified_doc(c: Certified) -> dict[str, Any]:
    return {
        "delta": c.delta,
        "dev_rows": c.rows,
        "threshold": c.knob,
        "refused": c.refused,
        "tested": [{"threshold": t, "p_value": p} for t, p in c.p_values],
        "dev_mean_loss": c.observed,
        "method": "Learn-then-Test: fixed-sequence testing, Waudby-Smith-Ramdas betting p-values",
    }


def policy_patch(
    policy: Path, specs: list[TierSpec], reports: list[SetReport], dev_rows: int, certified: str | None = None
) -> str:
    """The fitted temperatures and thresholds of the policy's own tiers, as a YAML fragment with
    what they achieved on the test rows as comments. The policy file itself is never edited."""
    lines = [
        f"# triage eval --patch: fitted on {dev_rows} dev rows of the data given; merge into {policy.name}",
        "# by hand (tiers are matched by name). Test rows, per set: cascade accuracy, share past the first tier",
        *([f"# {certified}"] if certified else []),
    ]
    lines += [
        f"#   {r.source} ({r.qtype}, n={r.n}): accuracy {r.cascade:.3f}, past first {r.past_first:.0%}" for r in reports
    ]
    lines += ["cascade:", "  tiers:"]
    for s in specs:
        if s.kind == "recorded":
            continue
        lines.append(f"    - name: {s.name}")
        if s.temperatures:
            lines.append("      temperature: {" + ", ".join(f"{k}: {v:g}" for k, v in s.temperatures.items()) + "}")
        if s.thresholds:
            lines.append("      thresholds: {" + ", ".join(f"{k}: {v:g}" for k, v in s.thresholds.items()) + "}")
        if s.accuracy:
            lines.append("      accuracy: {" + ", ".join(f"{k}: {v:g}" for k, v in s.accuracy.items()) + "}")
        if s.agreement:
            lines.append("      agreement:")
            lines += [f"        {k}: {{{_agreement(v)}}}" for k, v in s.agreement.items()]
    return "\n".join(lines) + "\n"


def _agreement(ag: Agreement) -> str:
    return ", ".join(f"{k}: {round(v, 4):g}" for k, v in ag.to_json().items())


@dataclass
class Inputs:
    """What the report says it was run on."""

    policy: Path
    data: list[Path]
    top: list[str]
    caps: tuple[int, int]
    problems: list[str]


def report_doc(inputs: Inputs, specs: list[TierSpec], measured: Measured, certified: Certified | None) -> Any:
    """``report.json``'s document (a measure with no rows behind it is null)."""
    return clean(
        {
            "version": 1,
            "policy": str(inputs.policy),
            "data": [str(p) for p in inputs.data],
            "top": inputs.top or None,
            "dev_cap": inputs.caps[0],
            "test_cap": inputs.caps[1],
            "skipped_lines": inputs.problems,
            **({"guarantee": certified_doc(certified)} if certified is not None else {}),
            "tiers": [
                {
                    "name": s.name,
                    "kind": s.kind,
                    "gate": s.gate_kind,
                    "escalation_margin": s.escalation_margin,
                    "temperature": s.temperatures,
                    "thresholds": s.thresholds,
                    "accuracy": s.accuracy or None,
                    "agreement": {k: v.to_json() for k, v in s.agreement.items()} or None,
                    "confidence_model": s.judge_fit or None,
                }
                for s in specs
            ],
            "sets": [asdict(r) for r in measured.sets],
            "pooled": measured.pooled,
            "gates": measured.gates,
        }
    )


def write(out: Path, doc: Any, reports: list[SetReport], specs: list[TierSpec], test: list[Row], plots: bool) -> None:
    """``report.json``, ``report.md`` and, with ``plots``, ``curves.png`` and ``reliability.png`` in ``out``."""
    from eval import report_md

    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(doc, indent=2, allow_nan=False))
    (out / "report.md").write_text(report_md.render(doc))
    if plots:
        from eval import plots as draw

        draw.curves(reports, out / "curves.png")
        draw.reliability(specs, test, out / "reliability.png")


def clean(x: object) -> object:
    """JSON without NaN: a measure with no rows behind it is null."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
