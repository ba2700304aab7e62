"""The policy a CLI command works on: loaded, or every problem printed and exit 2."""

from __future__ import annotations

from pathlib import Path

import typer

from policies import loader
from policies.errors import PolicyInvalid
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
