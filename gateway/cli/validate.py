"""``triage validate FILE...``: every problem of every file, with file:line:col and field path."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gateway.errors import PolicyInvalid
from policies import loader


def validate(files: Annotated[list[Path], typer.Argument(help="Policy files to check.")]) -> None:
    """Check policy files; exit 1 if any has a problem."""
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
        out.print(f"ok: {path} ({len(policy.backends)} backends, {len(policy.models)} models, "
                  f"{len(policy.virtual_models)} virtual models)", markup=False)
    if bad:
        raise typer.Exit(1)
