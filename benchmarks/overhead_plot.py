"""The overhead bench's plot (issue 35): added latency and throughput against concurrency, for each
row of the sweep (direct, triage, LiteLLM, ...), from one run's report: ``python -m benchmarks
overhead --plot PNG`` draws it after the run, ``python -m benchmarks overhead-plot REPORT PNG`` from a
saved report."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def draw(result: dict[str, Any], out: Path) -> Path:
    """Two panels sharing the concurrency axis (log 2): each row's p50 and p99 minus direct's at the
    same concurrency, and each row's requests per second. A row that left the sweep (p99 over the
    limit) stops where it left."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep: dict[str, list[dict[str, Any]]] = result["sweep"]
    direct = {r["concurrency"]: r for r in sweep.get("direct", [])}
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (name, rows) in enumerate(sweep.items()):
        color = colors[k % len(colors)]
        xs = [r["concurrency"] for r in rows]
        thr.plot(xs, [r["rps"] for r in rows], marker="o", label=name, color=color)
        if name == "direct":
            continue
        both = [r for r in rows if r["concurrency"] in direct]
        cs = [r["concurrency"] for r in both]
        added = [r["p50_ms"] - direct[r["concurrency"]]["p50_ms"] for r in both]
        lat.plot(cs, added, marker="o", label=f"{name} p50", color=color)
        lat.plot(
            cs,
            [r["p99_ms"] - direct[r["concurrency"]]["p99_ms"] for r in both],
            marker="x",
            linestyle="--",
            color=color,
            label=f"{name} p99",
        )
    for ax in (lat, thr):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    lat.set_yscale("symlog", linthresh=1.0)
    lat.set_ylabel("added latency (ms, against direct)")
    thr.set_yscale("log")
    thr.set_ylabel("requests per second")
    m = result.get("machine", {})
    fig.suptitle(
        f"Gateway overhead against concurrency: {m.get('cpu', '')}, "
        f"{m.get('date', '')[:10]}, {result['settings'].get('sweep_duration', '?')} s per point",
        fontsize=10,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
