"""``triage quality``: a running gateway's live quality estimates (``GET /admin/quality``) as a table,
and optionally a plot of the share of the top's answers kept with its interval, per model and
question type. Like ``triage keys`` it speaks HTTP to any gateway of a fleet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gateway.cli.keys import DEFAULT_URL, AdminKey, AsJson, Url, admin_call


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _span(pair: list[float | None]) -> str:
    lo, hi = pair
    return "-" if lo is None or hi is None else f"{100 * lo:.1f}-{100 * hi:.1f}"


def table(doc: dict[str, Any]) -> Table:
    target = doc.get("target")
    t = Table(
        title=f"live quality, last {doc['window_s'] / 86400:g} days" + (f", target {_pct(target)}" if target else "")
    )
    for col in (
        "model",
        "slice",
        "requests",
        "by top",
        "pairs",
        "agreement (95%)",
        "of top (95%)",
        "feedback right",
        "saved",
    ):
        t.add_column(col, justify="left" if col in ("model", "slice") else "right")
    drifting = {(d["model"], d["slice"]) for d in doc.get("drift", [])}
    for e in doc["estimates"]:
        style = "red" if (e["model"], e["slice"]) in drifting else None
        t.add_row(
            e["model"],
            e["slice"] or "all",
            str(e["records"]),
            _pct(e["top_share"]),
            str(e["pairs"]),
            f"{_pct(e['agreement'])} ({_span(e['agreement_interval'])})",
            f"{_pct(e['of_top'])} ({_span(e['of_top_interval'])})",
            f"{_pct(e['feedback_right'])} of {e['feedback']}" if e["feedback"] else "-",
            "-" if e["saved"] is None else f"{e['saved']:.4g}",
            style=style,
        )
    return t


def plot(doc: dict[str, Any], path: Path) -> None:
    """The share of the top's answers kept, each model and slice a bar with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [e for e in doc["estimates"] if e["of_top"] is not None]
    labels = [e["model"] + ("/" + e["slice"] if e["slice"] else "") for e in rows]
    est = [e["of_top"] for e in rows]
    err = [[e["of_top"] - e["of_top_interval"][0] for e in rows], [e["of_top_interval"][1] - e["of_top"] for e in rows]]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 4))
    ax.bar(range(len(rows)), est, yerr=err, capsize=4, color="#4c72b0")
    if doc.get("target"):
        ax.axhline(doc["target"], color="#c44e52", linestyle="--", label=f"target {doc['target']:g}")
        ax.legend(loc="lower right")
    ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("share of the top's answers kept (95% interval)")
    ax.set_title("live quality: answers kept below the top, against the top's")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def quality(
    url: Url = DEFAULT_URL,
    admin_key: AdminKey = "",
    plot_to: Annotated[Path | None, typer.Option("--plot", help="Also write a plot (PNG) here.")] = None,
    export: Annotated[
        Path | None,
        typer.Option(help="Also write the recorded decisions with a label as a labeled set (triage eval --data)."),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Live quality estimates from shadow checks and feedback: agreement with the top, money saved, drift."""
    doc = admin_call(url, admin_key, "GET", "/admin/quality")
    if export is not None:
        rows = admin_call(url, admin_key, "GET", "/admin/quality/traffic", text=True)
        export.parent.mkdir(parents=True, exist_ok=True)
        export.write_text(rows)
        typer.echo(f"labeled set: {export} ({rows.count(chr(10))} rows)", err=True)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        console = Console()
        console.print(table(doc))
        for d in doc.get("drift", []):
            console.print(f"[red]drift[/] {d['model']}{'/' + d['slice'] if d['slice'] else ''}: {d['reason']}")
        for r in doc.get("rollbacks", []):
            console.print(f"[red]rolled back[/] {r['split']}: {r['target']} -> {r['primary']} ({r['reason']})")
        for model, lat in doc.get("mirror_latency", {}).items():
            console.print(f"{model}: {lat['calls']} recent calls, p50 {lat['p50_ms']} ms, p95 {lat['p95_ms']} ms")
    if plot_to is not None:
        plot(doc, plot_to)
        typer.echo(f"plot: {plot_to}", err=True)
