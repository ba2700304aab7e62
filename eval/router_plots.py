"""The learned router's accuracy-cost curve beside its baselines, as a PNG."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

from eval.plots import _pyplot
from eval.router_eval import RouterReport, random_mixture


def curve_plot(r: RouterReport, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for a, b in combinations(r.singles.values(), 2):
        mix = random_mixture(a, b, 2)
        ax.plot([p.cost for p in mix], [p.accuracy for p in mix], color="lightgrey", lw=0.6, zorder=1)
    ax.scatter(
        [p.cost for p in r.singles.values()],
        [p.accuracy for p in r.singles.values()],
        color="black",
        s=12,
        zorder=3,
        label="single models (grey: random mixtures of two)",
    )
    ax.plot(
        [p.cost for p in r.router], [p.accuracy for p in r.router], color="tab:blue", zorder=4, label="learned router"
    )
    ax.scatter(
        [r.category_table.cost],
        [r.category_table.accuracy],
        marker="s",
        color="tab:orange",
        zorder=5,
        label="category table (best per category on dev)",
    )
    ax.scatter([r.oracle.cost], [r.oracle.accuracy], marker="*", s=80, color="tab:green", zorder=5, label="oracle")
    if len(r.singles) > 4:
        ax.set_xscale("log")
    ax.set_xlabel("mean cost per request")
    ax.set_ylabel("accuracy (test rows)")
    ax.set_title(f"{r.name}: {r.rows} test rows", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
