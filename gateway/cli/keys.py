"""``triage keys ...``: the admin API (``/admin``) from the command line: make, list, revoke and
rotate keys, read spend. It speaks HTTP to a running gateway, so it works against any gateway of
a fleet; the admin key comes from ``--admin-key`` or ``TRIAGE_ADMIN_KEY``."""

from __future__ import annotations

import json
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Keys and spend, through a running gateway's admin API.", no_args_is_help=True)

Url = Annotated[str, typer.Option(envvar="TRIAGE_URL", help="The gateway (any of a fleet).")]
AdminKey = Annotated[str, typer.Option(envvar="TRIAGE_ADMIN_KEY", help="The admin key (access.admin_key's).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the API's JSON.")]
DEFAULT_URL = "http://127.0.0.1:8080"


def admin_call(
    url: str, admin_key: str, method: str, path: str, body: Any = None, params: Any = None, text: bool = False
) -> Any:
    """The admin API's answer (its JSON, or with ``text`` its body); an error is printed and exits 1."""
    if not admin_key:
        typer.echo("error: no admin key: pass --admin-key or set TRIAGE_ADMIN_KEY", err=True)
        raise typer.Exit(2)
    try:
        r = httpx.request(
            method,
            url.rstrip("/") + path,
            json=body,
            params=params,
            headers={"authorization": f"Bearer {admin_key}"},
            timeout=30,
        )
    except httpx.HTTPError as exc:
        typer.echo(f"error: {url}: {exc}", err=True)
        raise typer.Exit(1) from None
    if text and r.status_code < 400:
        return r.text
    doc = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        message = (doc.get("error") or {}).get("message") if isinstance(doc, dict) else None
        typer.echo(f"error: {r.status_code}: {message or r.text}", err=True)
        raise typer.Exit(1)
    return doc


@app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="The key's name (logs, metrics and spend show it).")],
    model: Annotated[list[str] | None, typer.Option(help="A model it may ask for (repeat; default: all).")] = None,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute.")] = None,
    budget_per_day: Annotated[float | None, typer.Option(help="Spend per UTC day.")] = None,
    budget_per_month: Annotated[float | None, typer.Option(help="Spend per UTC month.")] = None,
    url: Url = DEFAULT_URL,
    admin_key: AdminKey = "",
    as_json: AsJson = False,
) -> None:
    """Make a key; its secret is printed once and kept nowhere."""
    limits = {"rpm": rpm, "tpm": tpm, "budget_per_day": budget_per_day, "budget_per_month": budget_per_month}
    body = {"name": name, "models": model or None, "limits": {k: v for k, v in limits.items() if v is not None}}
    doc = admin_call(url, admin_key, "POST", "/admin/keys", body)
    typer.echo(json.dumps(doc, indent=2) if as_json else doc["key"])


@app.command("list")
def list_keys(url: Url = DEFAULT_URL, admin_key: AdminKey = "", as_json: AsJson = False) -> None:
    """Every key: the policy's and the admin API's, revoked ones too."""
    doc = admin_call(url, admin_key, "GET", "/admin/keys")
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    table = Table("name", "source", "sha256", "active", "models", "limits")
    for k in doc["data"]:
        limits = ", ".join(f"{n}={v}" for n, v in k["limits"].items())
        table.add_row(
            k["name"], k["source"], k["sha256_prefix"], str(k["active"]), ",".join(k["models"] or ["*"]), limits
        )
    Console().print(table)


@app.command("revoke")
def revoke(
    name: Annotated[str, typer.Argument(help="The key's name.")],
    url: Url = DEFAULT_URL,
    admin_key: AdminKey = "",
) -> None:
    """Revoke a key: every gateway sharing the store refuses it within a second."""
    admin_call(url, admin_key, "DELETE", f"/admin/keys/{name}")
    typer.echo(f"revoked {name}")


@app.command("rotate")
def rotate(
    name: Annotated[str, typer.Argument(help="The key's name.")],
    grace: Annotated[float, typer.Option(help="Seconds the old key keeps working.")] = 0.0,
    url: Url = DEFAULT_URL,
    admin_key: AdminKey = "",
    as_json: AsJson = False,
) -> None:
    """A new secret for the key (same name, models and limits); the old one stops after --grace."""
    doc = admin_call(url, admin_key, "POST", f"/admin/keys/{name}/rotate", {"grace_s": grace})
    typer.echo(json.dumps(doc, indent=2) if as_json else doc["key"])


@app.command("spend")
def spend(
    key: Annotated[str | None, typer.Option(help="One key's name (default: every key).")] = None,
    since: Annotated[str | None, typer.Option("--from", help="First UTC day, YYYY-MM-DD (default: the 1st).")] = None,
    until: Annotated[str | None, typer.Option("--to", help="Last UTC day (default: today).")] = None,
    url: Url = DEFAULT_URL,
    admin_key: AdminKey = "",
    as_json: AsJson = False,
) -> None:
    """Spend per key, day and model, at the policy's prices."""
    params = {k: v for k, v in {"key": key, "from": since, "to": until}.items() if v}
    doc = admin_call(url, admin_key, "GET", "/admin/spend", params=params)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    table = Table("key", "day", "model", "cost", title=f"spend {doc['from']} .. {doc['to']}: {doc['total']}")
    for k in doc["keys"]:
        for row in k["days"]:
            table.add_row(k["key"], row["day"], row["model"], f"{row['cost']:.6f}")
    Console().print(table)
