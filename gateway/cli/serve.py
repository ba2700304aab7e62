"""``triage serve``: run the gateway under uvicorn."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Annotated

import typer

DEFAULT_POLICY = "default.yaml"


def default_policy_path() -> Path:
    return Path(str(files("policies").joinpath("examples", DEFAULT_POLICY)))


def serve(
    policy: Annotated[
        Path | None, typer.Option(help="Policy YAML (default: the embedded local policy).", envvar="TRIAGE_POLICY")
    ] = None,
    host: Annotated[str, typer.Option(envvar="TRIAGE_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="TRIAGE_PORT")] = 8080,
    watch: Annotated[bool, typer.Option(help="Reload the policy when its file changes.")] = True,
) -> None:
    """Serve the OpenAI-compatible API. SIGHUP reloads the policy."""
    import uvicorn

    from gateway.app import create_app
    from gateway.settings import Settings
    from policies import loader
    from policies.errors import PolicyInvalid

    settings = Settings(policy_path=policy or default_policy_path(), watch_policy=watch, freeze_gc=True)
    try:
        loader.load(settings.policy_path)  # refuse to start on a bad policy, with every problem
        if missing := loader.unset_secrets(settings.policy_path):  # or on secrets this host does not have
            raise PolicyInvalid(missing)
    except PolicyInvalid as exc:
        for problem in exc.problems:
            typer.echo(problem, err=True)
        raise typer.Exit(2) from None
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=10,
    )
