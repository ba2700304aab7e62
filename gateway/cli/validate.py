"""``triage validate FILE...``: every problem of every file, with file:line:col and field path."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from policies import catalogue, loader
from policies.errors import PolicyInvalid
from policies.schema import Policy


def validate(
    files: Annotated[list[Path], typer.Argument(help="Policy files to check.")],
    explain: Annotated[
        bool, typer.Option("--explain", help="Also say where each model's prices and context window come from.")
    ] = False,
) -> None:
    """Check policy files; exit 1 if any has a problem. Where the policy's heads are trained, the labels
    its semantic virtual models route on are checked against them too."""
    out = Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    bad = 0
    for path in files:
        try:
            policy = loader.load(path)
        except PolicyInvalid as exc:
            bad += 1
            for problem in exc.problems:
                err.print(problem, markup=False)
            continue
        problems = _label_problems(policy, path)
        if problems:
            bad += 1
            for problem in problems:
                err.print(f"{path}: {problem}", markup=False)
            continue
        for problem in loader.unset_secrets(path):  # a warning: the policy is right, this host's environment is not
            err.print(f"warning: {problem} (triage serve refuses to start without it)", markup=False)
        out.print(
            f"ok: {path} ({len(policy.backends)} backends, {len(policy.models)} models, "
            f"{len(policy.virtual_models)} virtual models)",
            markup=False,
        )
        if explain:
            _explain(out, path, policy)
    if bad:
        raise typer.Exit(1)


def _explain(out: Console, path: Path, policy: Policy) -> None:
    """Each model's prices (per million tokens) and context window, and where each came from: the
    policy, litellm's catalogue (policies/catalogue.py), or the default."""
    said = catalogue.sources(loader.load(path, catalogued=False))
    for name, spec in policy.models.items():
        p, window = spec.prices, spec.context_length
        out.print(
            f"  {name}: in {p.input_per_mtok:g} / out {p.output_per_mtok:g} per Mtok ({said[name]['prices']}); "
            f"context {window if window is not None else 'the engine says'} ({said[name]['context_length']})",
            markup=False,
        )


def _label_problems(policy: Policy, path: Path) -> list[str]:
    """Labels the semantic virtual models route on that the heads trained so far never answer."""
    if policy.classifier is None:
        return []
    from classifiers.heads import trained_classes
    from classifiers.service import artifacts_dir
    from policies.semantic import label_problems

    cfg = policy.classifier
    return label_problems(policy, trained_classes(artifacts_dir(cfg, path.parent), [*cfg.heads, *cfg.tasks]))
