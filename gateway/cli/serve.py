"""``triage serve``: run the gateway under uvicorn, in one process or ``--workers N``."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any

import typer

DEFAULT_POLICY = "default.yaml"
UVICORN: dict[str, Any] = {
    "loop": "uvloop",
    "http": "httptools",
    "log_level": "warning",
    "access_log": False,
    "timeout_graceful_shutdown": 10,
}


def default_policy_path() -> Path:
    return Path(str(files("policies").joinpath("examples", DEFAULT_POLICY)))


def serve(
    policy: Annotated[
        Path | None, typer.Option(help="Policy YAML (default: the embedded local policy).", envvar="TRIAGE_POLICY")
    ] = None,
    host: Annotated[str, typer.Option(envvar="TRIAGE_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="TRIAGE_PORT")] = 8080,
    watch: Annotated[bool, typer.Option(help="Reload the policy when its file changes.")] = True,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            envvar="TRIAGE_WORKERS",
            help="Worker processes on the port, each its own runtime; they share limits and spend only "
            "through state.store: redis (docs/operations.md, 'Several workers').",
        ),
    ] = 1,
) -> None:
    """Serve the OpenAI-compatible API. SIGHUP reloads the policy (in every worker)."""
    from gateway import supervisor as several
    from gateway.cli.policy_arg import start_problems
    from gateway.http.settings import Settings
    from gateway.obs import logs
    from policies import loader
    from policies.errors import PolicyInvalid

    settings = Settings(policy_path=policy or default_policy_path(), watch_policy=watch, freeze_gc=True)
    try:
        loaded = loader.load(settings.policy_path)  # refuse to start on a bad policy, with every problem
        if problems := start_problems(settings.policy_path, loaded, workers):  # or one this host cannot start
            raise PolicyInvalid(problems)
    except PolicyInvalid as exc:
        for problem in exc.problems:
            typer.echo(problem, err=True)
        raise typer.Exit(2) from None
    if workers > 1:
        logs.configure(loaded.logging)  # the parent's own events, as the workers log theirs
        if code := several.supervise(settings, host, port, workers, UVICORN):  # each worker guards its connections
            raise typer.Exit(code)
        return
    import uvicorn

    from gateway.http import connections
    from gateway.http.app import create_app

    uvicorn.run(create_app(settings), host=host, port=port, **connections.uvicorn_options(UVICORN, loaded.limits))
