"""``report.md``: the eval report for people, from the same document as ``report.json``."""

from __future__ import annotations

from typing import Any


def _f(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"# triage eval: {doc['policy']}",
        "",
        f"Data: {', '.join(doc['data'])}. Fitted on up to {doc['dev_cap']} dev rows per set, reported on up to "
        f"{doc['test_cap']} test rows per set" + (f"; top tier: recorded {doc['top']}." if doc["top"] else "."),
        "",
        "## Fitted",
        "",
        "| tier | kind | temperature | thresholds |",
        "|---|---|---|---|",
    ]
    for t in doc["tiers"]:
        lines.append(f"| {t['name']} | {t['kind']} | {t['temperature'] or '-'} | {t['thresholds'] or '-'} |")
    lines += [
        "",
        "## Per set (test rows)",
        "",
        "| set | type | n | alone (per tier) | cascade | answered by | past first | APGR | share for 50% / 80% "
        "of the gap | share for 95% / 100% of the best tier | ECE before -> after | Brier before -> after "
        "| latency p50 / p99 ms | cost per question (top alone) |",
        "|---|---|---:|---|---:|---|---:|---:|---|---|---|---|---|---|",
    ]
    for s in doc["sets"]:
        tiers = s["tiers"]
        alone = ", ".join(f"{t} {_f(s['alone'][t])}" for t in tiers)
        share = ", ".join(f"{t} {_f(s['share'][t], '.0%')}" for t in tiers)
        calib = ", ".join(f"{t} {_f(s['ece_raw'].get(t))} -> {_f(s['ece'][t])}" for t in tiers)
        brier = ", ".join(f"{t} {_f(s['brier_raw'].get(t))} -> {_f(s['brier'].get(t))}" for t in tiers)
        lat = ", ".join(
            f"{t} {_f(s['latency_p50_ms'].get(t), '.0f')} / {_f(s['latency_p99_ms'].get(t), '.0f')}" for t in tiers
        )
        c = s["curve"]
        a = c.get("anchored") or {}
        lines.append(
            f"| {s['source']} | {s['qtype']} | {s['n']} | {alone} | {_f(s['cascade'])} | {share} | "
            f"{_f(s['past_first'], '.0%')} | {_f(c['apgr'])} | {_f(c['share_for_50'], '.0%')} / "
            f"{_f(c['share_for_80'], '.0%')} | {_f(a.get('cost_for_95'), '.0%')} / {_f(a.get('cost_for_100'), '.0%')} "
            f"| {calib} | {brier} | {lat} | "
            f"{_f(s['cost_per_question'], '.4g')} ({_f(s['cost_top_per_question'], '.4g')}) |"
        )
    categories = [(s, c, v) for s in doc["sets"] for c, v in s["by_category"].items() if c != "-"]
    if categories:
        lines += [
            "",
            "## Per category (test rows)",
            "",
            "| set | category | n | cascade accuracy | past first |",
            "|---|---|---:|---:|---:|",
        ]
        lines += [
            f"| {s['source']} | {c} | {v['n']} | {_f(v['accuracy'])} | {_f(v['past_first'], '.0%')} |"
            for s, c, v in categories
        ]
    lines += [
        "",
        "APGR: area under the share of the first-to-last-tier accuracy gap recovered, against the share "
        "escalated past the first tier, sweeping one threshold for every tier but the last; random routing "
        "scores 0.5. The shares for 50% / 80% of the gap are RouteLLM's CPT(50%) / CPT(80%) (linear between "
        "the curve's points, as RouteLLM reads them). Plots: `curves.png`, `reliability.png`.",
        "",
    ]
    return "\n".join(lines)
