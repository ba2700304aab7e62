"""The policy a CLI command works on: loaded, or every problem printed and exit 2; and what stops
``triage serve`` from starting it on this host (:func:`start_problems`, which ``triage doctor`` runs too)."""

from __future__ import annotations

from pathlib import Path

import typer

from policies import loader
from policies.errors import PolicyInvalid
from policies.processes import per_process_problems
from policies.schema import Policy


def load_or_exit(path: Path, needs: str | None = None, why: str = "") -> Policy:
    """``needs`` names a section the command cannot do without (``classifier``, ``cascade``)."""
    try:
        policy = loader.load(path)
    except PolicyInvalid as exc:
        for problem in exc.problems:
            typer.echo(problem, err=True)
        raise typer.Exit(2) from None
    if needs is not None and getattr(policy, needs) is None:
        typer.echo(f"{path}: the policy has no `{needs}` section{why}", err=True)
        raise typer.Exit(2)
    return policy


def start_problems(path: Path, policy: Policy, workers: int = 1) -> list[str]:
    """Every reason ``triage serve`` refuses to start ``policy`` (loaded from ``path``) on this host,
    all at once: a secret referenced by an environment variable that is not set, a key's or the
    admin key's variable that holds no sha256, limits a worker of ``--workers N`` would keep alone.
    The one check of both ``triage serve`` and ``triage doctor``."""
    from gateway.service.assemble import secret_problems

    problems = loader.unset_secrets(path)
    if not problems:  # each unset one is said once, with its place in the file
        problems = secret_problems(policy)
    return problems + per_process_problems(policy, workers)
