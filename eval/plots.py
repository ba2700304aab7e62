"""PNG plots of an eval: cost-quality curves per set, reliability diagrams per tier and type."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from eval.cascade_eval import SetReport, TierSpec, right
from eval.tier_outputs import Row
from policies.cascade import read


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def curves(reports: Sequence[SetReport], path: Path) -> None:
    plt = _pyplot()
    shown = [r for r in reports if r.curve.points]
    cols = min(3, max(1, len(shown)))
    rows = max(1, -(-len(shown) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, r in zip(axes.flat, shown, strict=False):
        xs, ys = zip(*r.curve.points, strict=True)
        ax.plot(xs, ys, marker=".", label=f"cascade (APGR {r.curve.apgr:.2f})")
        ax.plot([0, 1], [r.curve.first, r.curve.last], linestyle="--", color="grey", label="random routing")
        ax.scatter([r.past_first], [r.cascade], color="red", zorder=3, label="fitted thresholds")
        ax.set_title(f"{r.source} ({r.qtype}, n={r.n})", fontsize=9)
        ax.set_xlabel("share escalated past the first tier")
        ax.set_ylabel("accuracy")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reliability(tiers: Sequence[TierSpec], rows: Sequence[Row], path: Path, bins: int = 10) -> None:
    """Accuracy against confidence (top-option probability, after temperature), per tier and type."""
    plt = _pyplot()
    groups: dict[tuple[str, str], list[tuple[float, bool]]] = defaultdict(list)
    for t in tiers:
        for r in rows:
            a = t.outputs.get(r.id)
            if a is None or a.scores is None or r.question.numeric:
                continue
            rd = read(r.question, t.gate(), a)
            groups[(t.name, r.question.type)].append((max(rd.probabilities.values()), right(r, rd.answer)))
    keys = sorted(groups)
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(3.4 * len(keys), 3.4), squeeze=False)
    edges = np.linspace(0, 1, bins + 1)
    for ax, key in zip(axes.flat, keys, strict=True):
        conf, ok = (np.array(v, dtype=float) for v in zip(*groups[key], strict=True))
        idx = np.clip(np.digitize(conf, edges[1:-1]), 0, bins - 1)
        mids = [(edges[b] + edges[b + 1]) / 2 for b in range(bins) if (idx == b).any()]
        accs = [ok[idx == b].mean() for b in range(bins) if (idx == b).any()]
        ax.bar(mids, accs, width=1 / bins, edgecolor="black", alpha=0.7)
        ax.plot([0, 1], [0, 1], linestyle="--", color="grey")
        ax.set_title(f"{key[0]} / {key[1]} (n={len(conf)})", fontsize=9)
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
