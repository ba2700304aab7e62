"""The ``triage`` command: one module per subcommand."""

from __future__ import annotations

import typer

from gateway.cli import cache, doctor, evaluate, keys, quality, route, serve, train, validate

app = typer.Typer(
    name="triage",
    help="An OpenAI-compatible gateway that routes each request to the cheapest tier that can answer it well.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("serve")(serve.serve)
app.command("validate")(validate.validate)
app.command("doctor")(doctor.doctor)
app.command("train")(train.train)
app.command("route")(route.route)
app.command("eval")(evaluate.evaluate)
app.command("calibrate")(evaluate.calibrate)
app.command("quality")(quality.quality)
app.add_typer(keys.app, name="keys")
app.add_typer(cache.app, name="cache")


def main() -> None:
    app()
