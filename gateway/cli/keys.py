"""``triage keys ...``: the admin API (``/admin``) from the command line: make, list, revoke and
rotate keys, read spend (per key, team or user), make and list teams, read the audit log. It speaks
HTTP to a running gateway, so it works against any gateway of a fleet; the credential (the admin
key, a key with a role, or a signed token) comes from ``--admin-key`` or ``TRIAGE_ADMIN_KEY``."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Keys and spend, through a running gateway's admin API.", no_args_is_help=True)

Url = Annotated[str, typer.Option(envvar="TRIAGE_URL", help="The gateway (any of a fleet).")]
AdminKey = Annotated[
    str, typer.Option(envvar="TRIAGE_ADMIN_KEY", help="The admin key, a key with a role, or a signed token.")
]
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
    team: Annotated[str | None, typer.Option(help="Its team (its models and limits hold too).")] = None,
    user: Annotated[str | None, typer.Option(help="The person or service it stands for.")] = None,
    role: Annotated[str | None, typer.Option(help="admin, operator, viewer or team_admin.")] = None,
    url: Url = DEFAULT_URL,
    admin_key: AdminKey = "",
    as_json: AsJson = False,
) -> None:
    """Make a key; its secret is printed once and kept nowhere."""
    limits = {"rpm": rpm, "tpm": tpm, "budget_per_day": budget_per_day, "budget_per_month": budget_per_month}
    body: dict[str, Any] = {"name": name, "models": model or None, "limits": _set(limits)}
    body.update(_set({"team": team, "user": user, "role": role}))
    doc = admin_call(url, admin_key, "POST", "/admin/keys", body)
    typer.echo(json.dumps(doc, indent=2) if as_json else doc["key"])


@app.command("list")
def list_keys(url: Url = DEFAULT_URL, admin_key: AdminKey = "", as_json: AsJson = False) -> None:
    """Every key: the policy's and the admin API's, revoked ones too."""
    doc = admin_call(url, admin_key, "GET", "/admin/keys")
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    table = Table("name", "source", "sha256", "active", "team", "user", "role", "models", "limits")
    for k in doc["data"]:
        limits = ", ".join(f"{n}={v}" for n, v in k["limits"].items())
        who = [k.get("team") or "", k.get("user") or "", k.get("role") or ""]
        models = ",".join(k["models"] or ["*"])
        table.add_row(k["name"], k["source"], k["sha256_prefix"], str(k["active"]), *who, models, limits)
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
    team: Annotated[str | None, typer.Option(help="One team: its keys, and the team's own total.")] = None,
    user: Annotated[str | None, typer.Option(help="One user: its keys, and the user's own total.")] = None,
    since: Annotated[str | None, typer.Option("--from", help="First UTC day, YYYY-MM-DD (default: the 1st).")] = None,
    until: Annotated[str | None, typer.Option("--to", help="Last UTC day (default: today).")] = None,
    url: Url = DEFAULT_URL,
    admin_key: AdminKey = "",
    as_json: AsJson = False,
) -> None:
    """Spend per key (and team or user), day and model, at the policy's prices."""
    params = _set({"key": key, "team": team, "user": user, "from": since, "to": until})
    doc = admin_call(url, admin_key, "GET", "/admin/spend", params=params)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    table = Table("who", "day", "model", "cost", title=f"spend {doc['from']} .. {doc['to']}: {doc['total']}")
    whole = [(f"team {doc['team']['team']}", doc["team"])] if "team" in doc else []
    whole += [(f"user {doc['user']['user']}", doc["user"])] if "user" in doc else []
    for who, rows in [*whole, *((k["key"], k) for k in doc["keys"])]:
        for row in rows["days"]:
            table.add_row(who, row["day"], row["model"], f"{row['cost']:.6f}")
    Console().print(table)


def _set(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


teams = typer.Typer(help="Teams: their models and the limits their keys share.", no_args_is_help=True)
app.add_typer(teams, name="teams")


@teams.command("create")
def team_create(
    name: Annotated[str, typer.Argument(help="The team's name.")],
    model: Annotated[
        list[str] | None, typer.Option(help="A model its keys may ask for (repeat; default: all).")
    ] = None,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute, all its keys together.")] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute, all its keys together.")] = None,
    budget_per_day: Annotated[float | None, typer.Option(help="Spend per UTC day, all its keys together.")] = None,
    budget_per_month: Annotated[float | None, typer.Option(help="Spend per UTC month.")] = None,
    update: Annotated[bool, typer.Option("--update", help="Change a team the admin API made.")] = False,
    url: Url = DEFAULT_URL,
    admin_key: AdminKey = "",
) -> None:
    """Make a team (or with --update change one)."""
    limits = _set({"rpm": rpm, "tpm": tpm, "budget_per_day": budget_per_day, "budget_per_month": budget_per_month})
    body: dict[str, Any] = {"models": model or None, "limits": limits}
    if update:
        admin_call(url, admin_key, "PUT", f"/admin/teams/{name}", body)
    else:
        admin_call(url, admin_key, "POST", "/admin/teams", {"name": name, **body})
    typer.echo(f"{'changed' if update else 'made'} {name}")


@teams.command("list")
def team_list(url: Url = DEFAULT_URL, admin_key: AdminKey = "", as_json: AsJson = False) -> None:
    """Every team: the policy's and the admin API's."""
    doc = admin_call(url, admin_key, "GET", "/admin/teams")
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    table = Table("name", "source", "models", "limits")
    for t in doc["data"]:
        limits = ", ".join(f"{n}={v}" for n, v in t["limits"].items())
        table.add_row(t["name"], t["source"], ",".join(t["models"] or ["*"]), limits)
    Console().print(table)


@teams.command("delete")
def team_delete(
    name: Annotated[str, typer.Argument(help="The team's name.")], url: Url = DEFAULT_URL, admin_key: AdminKey = ""
) -> None:
    """Delete a team the admin API made (refused while a live key belongs to it)."""
    admin_call(url, admin_key, "DELETE", f"/admin/teams/{name}")
    typer.echo(f"deleted {name}")


@app.command("audit")
def audit(
    limit: Annotated[int, typer.Option(help="How many of the newest entries.")] = 50,
    url: Url = DEFAULT_URL,
    admin_key: AdminKey = "",
    as_json: AsJson = False,
) -> None:
    """The audit log of admin actions, newest first: who, what, when, from where, and the outcome."""
    doc = admin_call(url, admin_key, "GET", "/admin/audit", params={"limit": limit})
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    table = Table("when (UTC)", "who", "role", "action", "target", "outcome", "from")
    for e in doc["data"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["at"]))
        table.add_row(
            when, e["who"], e["role"], e["action"], e["target"], f"{e['outcome']} {e['status']}", e["client"] or ""
        )
    Console().print(table)
