"""``triage eval``: the cascade of a policy on labeled typed sets, each tier alone and together."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from gateway.cli.policy_arg import load_or_exit

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
    fail_under: Annotated[
        str | None,
        typer.Option(
            help="Gates for CI, e.g. accuracy=0.8,ece=0.05 (also apgr, escalation): exit 1 when one is missed."
        ),
    ] = None,
    plots: Annotated[bool, typer.Option(help="Draw curves.png and reliability.png.")] = True,
    router: _Router = None,
    cv_by: Annotated[
        str,
        typer.Option(
            help="With --router, for a labels file without dev and test rows: cross-validation folds by 'row' or "
            "by 'category' (BBH's tasks: no task both fitted and measured)"
        ),
    ] = "row",
    tiers: _Tiers = None,
    task: _Tasks = None,
    guarantee: _Guarantee = None,
) -> None:
    """Fit temperatures and thresholds on dev rows, then report each tier and the cascade on test rows.
    With --router: the learned router of a routed model against every single model, random mixtures,
    the category table and the oracle (gates: apgr=X, ...)."""
    from eval import gates

    if router is not None:
        from gateway.cli.router import evaluate_router

        if cv_by not in ("row", "category"):
            typer.echo(f"--cv-by is 'row' or 'category', not {cv_by!r}", err=True)
            raise typer.Exit(2)
        return evaluate_router(policy, router, out, fail_under, plots, cv_by, (dev_cap, test_cap))
    data = _need_data(data, task)
    console = Console(highlight=False)
    limits = _parsed(lambda: gates.parse(fail_under or ""), "--fail-under")
    goal = _parsed(lambda: _target(target), "--target")
    caps = (CAP if dev_cap is None else dev_cap, CAP if test_cap is None else test_cap)
    run = _Run.prepare(console, policy, data, out, (top or [], top_price), *caps, _names(tiers), task or [])
    if guarantee is not None and (goal is None or goal[0] not in ("of_top", "escalation", "cost")):
        typer.echo("--guarantee needs --target of_top=X, escalation=X or cost=X", err=True)
        raise typer.Exit(2)
    run.guarantee = guarantee
    reports = run.fit_and_report(slack, goal)
    if run.certified is not None and run.certified.refused:
        c = run.certified
        typer.echo(
            f"--guarantee {c.delta:g}: refused. Not even the safest threshold is certified on {c.rows} dev rows "
            f"(p-value {c.p_values[0][1]:.3g} > {c.delta:g}): give more dev rows (--dev-cap, more data) or a looser "
            "target. No patch written.",
            err=True,
        )
        raise typer.Exit(1)
    run.write(reports, plots)
    if patch is not None:
        line = _certified_line(goal, run.certified) if goal is not None and run.certified is not None else None
        patch.write_text(policy_patch(policy, run.specs, reports, len(run.dev), line))
        console.print(f"wrote {patch} (review it, then merge it into {policy} yourself)")
    missed = gates.failures(reports, limits)
    for line in missed:
        console.print(f"[red]fail-under[/red]: {line}")
    if missed:
        raise typer.Exit(1)


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


def fit_gates(console: Console, policy: Path, data: list[Path], dev_cap: int, out: Path) -> list[Path]:
    """``triage train``'s learned gates: each tier with ``gate: learned`` gets its confidence model,
    fitted on the dev rows of ``data`` from the tiers' answers (cached in ``out/cache``, shared with
    ``triage eval --out out``), at the policy's own temperatures; saved where the runtime reads it."""
    from eval import cascade_eval
    from gateway.service.assemble import judges_dir

    pol = load_or_exit(policy, "cascade")
    assert pol.cascade is not None  # load_or_exit: the policy has one
    tiers = pol.cascade.tiers
    learned = [i for i, t in enumerate(tiers) if t.gate == "learned"]
    if not learned:
        return []
    where = judges_dir(pol, policy.resolve().parent)
    if where is None:
        typer.echo(
            "cascade: a tier has `gate: learned` but neither cascade.artifacts nor a classifier says where", err=True
        )
        raise typer.Exit(2)
    upto = max(learned) + 1  # the tiers a learned gate reads: itself and those before it
    run = _Run.prepare(console, policy, data, out, ([], 0.0), dev_cap, 0, [t.name for t in tiers[:upto]])
    for spec, tier in zip(run.specs, tiers, strict=False):
        spec.temperatures = dict(tier.temperature)  # the policy's: the gate reads what the gateway will
    cascade_eval.fit_judges(run.specs, run.dev, upto=upto)
    written = []
    for i in learned:
        spec = run.specs[i]
        if spec.judge is None:
            typer.echo(f"tier {spec.name}: no confidence model: {spec.judge_fit.get('error')}", err=True)
            raise typer.Exit(1)
        written.append(spec.judge.save(where))
        fit = spec.judge_fit
        console.print(
            f"gate {spec.name}: {fit['variant']} (C {fit['C']}) on {fit['rows']} dev rows, {fit['right']} right; "
            f"out-of-fold AUROC {fit['dev_auroc']:.3f} against its own confidence's {fit['dev_auroc_raw']:.3f}"
        )
    return written


def _task_rows(pol: Any, policy: Path, name: str, dev_cap: int, test_cap: int) -> tuple[list, list]:
    from classifiers.service import data_dir
    from eval.tier_outputs import intent_rows

    if pol.classifier is None or name not in pol.classifier.tasks:
        known = ", ".join(pol.classifier.tasks) if pol.classifier is not None else "none"
        typer.echo(f"--task {name}: not a task of the policy's classifier (it has: {known or 'none'})", err=True)
        raise typer.Exit(2)
    spec = pol.classifier.tasks[name]
    path = data_dir(pol.classifier, policy.resolve().parent) / spec.data
    if not path.is_file():
        typer.echo(f"--task {name}: no such file: {path}", err=True)
        raise typer.Exit(2)
    rows = [
        intent_rows(path, name, split, cap, 5, spec.text_field, spec.label_field)
        for split, cap in (("dev", dev_cap), ("test", test_cap))
    ]
    return rows[0], rows[1]


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


def _target(spec: str | None) -> tuple[str, float] | None:
    if not spec:
        return None
    key, sep, value = spec.partition("=")
    if not sep or key not in ("accuracy", "escalation", "cost", "of_top"):
        raise ValueError(f"'{spec}': expected accuracy=X, escalation=X, cost=X or of_top=X")
    x = float(value)
    if not 0 <= x <= (float("inf") if key == "cost" else 1):
        raise ValueError(f"'{spec}': X must be within [0, 1]" if key != "cost" else f"'{spec}': a cost is >= 0")
    return key, x


@dataclass
class _Run:
    console: Console
    policy: Path
    data: list[Path]
    out: Path
    top: tuple[list[str], float]  # recorded models as one top tier, and its price per question
    caps: tuple[int, int]
    dev: list
    test: list
    problems: list[str]
    specs: list = field(default_factory=list)
    only: list[str] | None = None  # the policy's tiers to run (None: all)
    guarantee: float | None = None  # --guarantee DELTA
    certified: Any = None  # eval.guarantee.Certified, with --guarantee

    @classmethod
    def prepare(
        cls,
        console: Console,
        policy: Path,
        data: list[Path],
        out: Path,
        top: tuple[list[str], float],
        dev_cap: int,
        test_cap: int,
        only: list[str] | None = None,
        tasks: list[str] | None = None,
    ) -> _Run:
        from eval.tier_outputs import typed_rows

        pol = load_or_exit(policy, "cascade")
        missing = [str(p) for p in data if not p.is_file()]
        if missing:
            typer.echo(f"no such file: {', '.join(missing)}", err=True)
            raise typer.Exit(2)
        problems: list[str] = []
        dev = [r for p in data for r in typed_rows(p, "dev", dev_cap, problems)]
        test = [r for p in data for r in typed_rows(p, "test", test_cap, problems)]
        for name in tasks or []:
            task_dev, task_test = _task_rows(pol, policy, name, dev_cap, test_cap)
            dev, test = dev + task_dev, test + task_test
        problems = list(dict.fromkeys(problems))  # a file's bad lines are met once per split read
        for line in problems:
            console.print(f"[yellow]skipped[/yellow] {line}")
        if not test and test_cap > 0:
            typer.echo("no typed test rows in the given files", err=True)
            raise typer.Exit(2)
        run = cls(console, policy, data, out, top, (dev_cap, test_cap), dev, test, problems, only=only)
        run.specs = run._tier_outputs(pol)
        return run

    def _recorded_dir(self) -> Path:
        return self.data[0].resolve().parents[1] if self.data else Path(".")

    def _tier_outputs(self, pol: Any) -> list:
        from eval import cascade_eval, tier_runs
        from eval.tier_outputs import TierCache
        from gateway.cli.live_tier import Live
        from policies.tiers import EncoderTier, ScorerTier

        base, rows, specs = self.policy.resolve().parent, self.dev + self.test, []
        live: Live | None = None
        chosen = [t for t in pol.cascade.tiers if self.only is None or t.name in self.only]
        unknown = sorted(set(self.only or ()) - {t.name for t in pol.cascade.tiers})
        if unknown or not chosen:
            typer.echo(
                f"--tiers: no tier named {', '.join(unknown) or 'any of them'} in the policy's cascade", err=True
            )
            raise typer.Exit(2)
        clf = None
        if pol.classifier is not None:  # loaded once: the embeddings of the rows and the encoder tier
            from classifiers.service import Classifier

            clf = Classifier.load(pol.classifier, base)
            rows = self._embedded(pol, clf)
        for tier in chosen:
            if isinstance(tier, EncoderTier):
                compute, fingerprint = tier_runs.encoder(pol, base, clf)
                key = f"encoder-{pol.classifier.encoder.precision}-{fingerprint}"
            elif isinstance(tier, ScorerTier):
                b = pol.backends[tier.backend]
                model = b.gguf.package or Path(b.gguf.path or "").name
                compute = tier_runs.scorer(pol, tier)
                if tier.mode == "lettered":
                    from backends.lettered import PROMPT_VERSION

                    key = f"scorer-{model}-lettered-v{PROMPT_VERSION}"
                elif tier.mode == "reasoned":
                    from backends.lettered import REASONED_VERSION

                    key = f"scorer-{model}-reasoned{tier.reason_tokens}-v{REASONED_VERSION}"
                else:
                    key = f"scorer-{model}-t{tier.templates.version}-{tier.length_norm}"
                key += f"-orders{tier.orders}" if tier.orders > 1 else ""
            else:
                live = live or Live(pol, base)
                compute, key = live.compute(tier), f"model-{tier.model}-{pol.upstream_name(tier.model)}"
            cache = TierCache(self.out / "cache" / f"{key}.jsonl")
            outputs = _fill(self.console, cache, rows, compute, tier.name)
            specs.append(
                cascade_eval.TierSpec(
                    tier.name,
                    tier.type,
                    outputs,
                    per_call=tier.prices.per_call,
                    per_1k_tokens=tier.prices.per_1k_tokens,
                    gate_kind=tier.gate,
                    escalation_margin=tier.escalation_margin,
                    thresholds=dict(tier.thresholds),
                    task_thresholds=dict(tier.task_thresholds),
                    orders=tier.orders if isinstance(tier, ScorerTier) else 1,
                )
            )
        if live is not None:
            live.close()
        names, price = self.top
        if names:
            computes: dict = {}
            for name in names:  # the first model given that covers a set answers it
                for source, compute in tier_runs.recorded(self._recorded_dir(), name).items():
                    computes.setdefault(source, compute)
            outputs = {r.id: computes[r.source](r) for r in rows if r.source in computes}
            label = names[0] if len(names) == 1 else "top"
            specs.append(cascade_eval.TierSpec(label, "recorded", outputs, per_call=price))
        return specs

    def _embedded(self, pol: Any, clf: Any) -> list:
        """The rows with their question embeddings (for learned gates), cached beside the tier outputs."""
        from eval.tier_outputs import with_embeddings

        enc = pol.classifier.encoder
        path = self.out / "cache" / f"embeddings-{enc.precision}-l{enc.layers}-t{enc.max_tokens}.npz"
        with self.console.status("embedding the questions"):
            self.dev = with_embeddings(self.dev, path, clf.encoder.embed)
            self.test = with_embeddings(self.test, path, clf.encoder.embed)
        return self.dev + self.test

    def fit_and_report(self, slack: float, goal: tuple[str, float] | None) -> list:
        from eval import cascade_eval

        for spec in self.specs:
            if spec.kind != "recorded":  # a recorded answer carries no probabilities to calibrate
                cascade_eval.fit_temperatures(spec, self.dev)
        cascade_eval.fit_judges(self.specs, self.dev)
        if goal is not None and self.guarantee is not None:
            self.certified = cascade_eval.fit_with_guarantee(self.specs, self.dev, goal, self.guarantee)
            self.console.print(_certified_line(goal, self.certified))
        elif goal is not None and goal[0] == "cost":
            cascade_eval.fit_for_cost(self.specs, self.dev, goal[1])
        elif goal is not None and goal[0] == "of_top":
            cascade_eval.fit_for_share_of_top(self.specs, self.dev, goal[1])
        else:
            cascade_eval.fit_thresholds(self.specs, self.dev, slack, goal)
        reports = cascade_eval.evaluate(self.specs, self.test)
        _print(self.console, self.specs, reports)
        self.gate_rows = cascade_eval.gate_table(self.specs, self.test)
        # every set together; and, where task rows were given (mixed traffic), the typed sets alone
        self.pooled = {"all": cascade_eval.pooled(reports)}
        if any(r.task for r in reports):
            self.pooled["typed"] = cascade_eval.pooled([r for r in reports if not r.task])
        _print_pooled(self.console, self.pooled, self.gate_rows)
        if goal is not None:
            self.console.print(_check_target(goal, cascade_eval.evaluate(self.specs, self.dev), reports))
        return reports

    def write(self, reports: list, plots: bool) -> None:
        from eval import report_md

        self.out.mkdir(parents=True, exist_ok=True)
        doc: Any = _clean(
            {
                "version": 1,
                "policy": str(self.policy),
                "data": [str(p) for p in self.data],
                "top": self.top[0] or None,
                "dev_cap": self.caps[0],
                "test_cap": self.caps[1],
                "skipped_lines": self.problems,
                **({"guarantee": _certified_doc(self.certified)} if self.certified is not None else {}),
                "tiers": [
                    {
                        "name": s.name,
                        "kind": s.kind,
                        "gate": s.gate_kind,
                        "escalation_margin": s.escalation_margin,
                        "temperature": s.temperatures,
                        "thresholds": s.thresholds,
                        "confidence_model": s.judge_fit or None,
                    }
                    for s in self.specs
                ],
                "sets": [asdict(r) for r in reports],
                "pooled": getattr(self, "pooled", {}),
                "gates": getattr(self, "gate_rows", []),
            }
        )
        (self.out / "report.json").write_text(json.dumps(doc, indent=2, allow_nan=False))
        (self.out / "report.md").write_text(report_md.render(doc))
        if plots:
            from eval import plots as draw

            draw.curves(reports, self.out / "curves.png")
            draw.reliability(self.specs, self.test, self.out / "reliability.png")
        self.console.print(
            f"wrote {self.out / 'report.json'}, report.md" + (", curves.png, reliability.png" if plots else "")
        )


def _pooled(reports: list, attr: str) -> float:
    n = sum(r.n for r in reports)
    return sum(getattr(r, attr) * r.n for r in reports if math.isfinite(getattr(r, attr))) / n if n else math.nan


def _check_target(goal: tuple[str, float], dev: list, test: list) -> str:
    """Whether the target held on test rows (within 2 points), and by how much it missed if not."""
    if goal[0] == "of_top":
        from eval.cascade_eval import pooled

        d, t = pooled(dev), pooled(test)
        verdict = (
            "held"
            if t["of_top"] >= goal[1] - 0.02
            else f"[red]missed by {(goal[1] - t['of_top']) * 100:.1f} points[/red]"
        )
        return (
            f"target of_top {goal[1]}: dev {d['of_top']:.3f} ({d['reached_top']:.0%} reached the top), "
            f"test {t['of_top']:.3f} ({t['reached_top']:.0%}): {verdict}"
        )
    attr = {"accuracy": "cascade", "escalation": "past_first", "cost": "cost_per_question"}[goal[0]]
    on_dev, on_test = _pooled(dev, attr), _pooled(test, attr)
    miss = (goal[1] - on_test) if goal[0] == "accuracy" else (on_test - goal[1])
    if goal[0] == "cost":  # within 2% of the budget
        verdict = "held" if miss <= 0.02 * goal[1] else f"[red]over budget by {miss / goal[1]:.1%}[/red]"
    else:
        verdict = "held" if miss <= 0.02 else f"[red]missed by {miss * 100:.1f} points[/red]"
    return f"target {goal[0]} {goal[1]}: dev {on_dev:.3f}, test {on_test:.3f}: {verdict}"


def _certified_line(goal: tuple[str, float], c: Any) -> str:
    """What --guarantee certified, in a sentence (the console, the patch and the report say it)."""
    kind, x = goal
    if c.knob is None:
        return f"guarantee: refused ({c.rows} dev rows; the safest threshold's p-value {c.p_values[0][1]:.3g})"
    return (
        f"guarantee: {kind} {'>=' if kind == 'of_top' else '<='} {x:g} on new traffic like the {c.rows} dev rows, "
        f"with probability >= {1 - c.delta:g} (Learn-then-Test, fixed sequence, betting p-values): threshold "
        f"{c.knob:g} for every tier but the last, {c.tested} thresholds tested"
    )


def _certified_doc(c: Any) -> dict[str, Any]:
    return {
        "delta": c.delta,
        "dev_rows": c.rows,
        "threshold": c.knob,
        "refused": c.refused,
        "tested": [{"threshold": t, "p_value": p} for t, p in c.p_values],
        "dev_mean_loss": c.observed,
        "method": "Learn-then-Test: fixed-sequence testing, Waudby-Smith-Ramdas betting p-values",
    }


def policy_patch(policy: Path, specs: list, reports: list, dev_rows: int, certified: str | None = None) -> str:
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
    with Progress(
        TextColumn(f"{name:>10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(name, total=len(rows))
        return cache.fill(rows, compute, lambda: bar.advance(task))  # type: ignore[attr-defined]


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
