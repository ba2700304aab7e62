"""The encoder benchmark's goals and its printed tables (rich)."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.encoder_backends import ONNX_FP32, ONNX_INT8, ONNX_INT8_SLN, ONNX_INT8_TOGETHER, PYTORCH
from benchmarks.encoder_floor import INT8_FLOOR
from benchmarks.report import goals_table

# the goals
P50_32_MAX_MS = 2.5
DECISIONS_2CORE_MIN = 600.0
ORDER = (ONNX_INT8, ONNX_INT8_TOGETHER, ONNX_INT8_SLN, ONNX_FP32, PYTORCH, INT8_FLOOR)
FEWER_LAYERS = "onnx-int8-l"  # + N: int8 of an export that keeps the first N layers (bench encoder --layers N)


def _order(present: dict[str, Any]) -> list[str]:
    """The contestants in table order: the fewer-layer exports right after int8."""
    fewer = sorted(n for n in present if n.startswith(FEWER_LAYERS))
    return [n for n in (ORDER[0], *fewer, *ORDER[1:]) if n in present]


def _get(d: dict[str, Any], *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    p50 = _get(res, "single", ONNX_INT8, "32", "p50_ms")
    floor = _get(res, "single", INT8_FLOOR, "32", "p50_ms")
    tp = _get(res, "throughput", ONNX_INT8, "2", "decisions_per_s")
    pair = _get(res, "throughput", "onnx-int8-2x1", "2", "decisions_per_s")
    tokens = _get(res, "throughput", "tokens")
    rows = [
        {
            "goal": f"int8 p50 <= {P50_32_MAX_MS:g} ms, 32-token prompt, one core",
            "value": p50,
            "unit": "ms",
            "pass": p50 is not None and p50 <= P50_32_MAX_MS,
        },
        {
            "goal": f">= {DECISIONS_2CORE_MIN:g} decisions/s micro-batched on two cores (int8, intra-op 2, "
            f"{tokens} tokens)",
            "value": tp,
            "unit": "/s",
            "pass": tp is not None and tp >= DECISIONS_2CORE_MIN,
        },
        {
            "goal": f"(info) two 1-thread int8 sessions side by side, {tokens} tokens",
            "value": pair,
            "unit": "/s",
            "pass": None,
        },
        {
            "goal": "(info) int8 vs fp32 mean cosine",
            "value": _get(res, "agreement", "int8_vs_fp32", "mean_cosine"),
            "unit": "",
            "pass": None,
        },
        {
            "goal": "(info) int8 p50 / int8 with SkipLayerNorm fused, 32 tokens, one core",
            "value": _ratio(_get(res, "single", ONNX_INT8_SLN, "32", "p50_ms"), p50),
            "unit": "x",
            "pass": None,
        },
        {
            "goal": "(info) floor: the int8 matrix products alone, 32 tokens, one core "
            f"({P50_32_MAX_MS:g} ms is reachable only if this is well under it)",
            "value": floor,
            "unit": "ms",
            "pass": None,
        },
        {
            "goal": "(info) share of the int8 p50 that the matrix products take, 32 tokens",
            "value": _ratio(p50, floor),
            "unit": "",
            "pass": None,
        },
    ]
    for name in _order(res.get("single", {})):
        if name.startswith(FEWER_LAYERS):  # the same goals for an export with fewer layers (other heads)
            n = name.removeprefix(FEWER_LAYERS)
            p50, tp = _get(res, "single", name, "32", "p50_ms"), _get(res, "throughput", name, "2", "decisions_per_s")
            rows += [
                {
                    "goal": f"int8, first {n} layers: p50 <= {P50_32_MAX_MS:g} ms, 32 tokens, one core",
                    "value": p50,
                    "unit": "ms",
                    "pass": p50 is not None and p50 <= P50_32_MAX_MS,
                },
                {
                    "goal": f"int8, first {n} layers: >= {DECISIONS_2CORE_MIN:g} decisions/s on two cores",
                    "value": tp,
                    "unit": "/s",
                    "pass": tp is not None and tp >= DECISIONS_2CORE_MIN,
                },
            ]
    return rows


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or a <= 0 else b / a


def _latency_table(res: dict[str, Any], key: str, title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("tokens", "contestant", "p50", "p90", "p99", "p50 speed-up vs pytorch"):
        t.add_column(col, justify="left" if col == "contestant" else "right")
    names = _order(res[key])
    for length, tr in res["truncation"].items():
        base = _get(res, key, PYTORCH, length, "p50_ms")
        for i, n in enumerate(names):
            label = "" if i else length
            if i == 1 and tr["onnx_kept"] != tr["tokens"]:
                label = f"kept {tr['onnx_kept']}"
            p50 = _get(res, key, n, length, "p50_ms")
            t.add_row(
                label,
                n,
                _num(p50),
                _num(_get(res, key, n, length, "p90_ms")),
                _num(_get(res, key, n, length, "p99_ms")),
                _num(_ratio(p50, base), "{:.1f}x"),
                end_section=i == len(names) - 1,
            )
    return t


def _throughput_table(res: dict[str, Any]) -> Table:
    tp = res["throughput"]
    t = Table(
        title=f"Decisions per second, micro-batched, {tp['tokens']}-token prompts "
        f"(max batch {res['settings']['max_batch']}, {res['settings']['max_wait_ms']:g} ms)",
        title_justify="left",
    )
    for col in (
        "contestant",
        "one core (intra-op 1)",
        "two cores (intra-op 2)",
        "mean batch (1 / 2)",
        "vs pytorch (1 / 2)",
    ):
        t.add_column(col, justify="left" if col == "contestant" else "right")
    for name in (*_order(tp), "onnx-int8-2x1"):
        if name not in tp:
            continue
        one, two = _get(tp, name, "1", "decisions_per_s"), _get(tp, name, "2", "decisions_per_s")
        vs = [_ratio(_get(tp, PYTORCH, c, "decisions_per_s"), v) for c, v in (("1", one), ("2", two))]
        t.add_row(
            name if name != "onnx-int8-2x1" else "onnx-int8, 2 sessions x 1 thread",
            _num(one, "{:.0f}"),
            _num(two, "{:.0f}"),
            " / ".join(_num(_get(tp, name, c, "mean_batch"), "{:.1f}") for c in ("1", "2")),
            " / ".join(_num(v, "{:.1f}x") for v in vs),
        )
    return t


def _agreement_table(res: dict[str, Any]) -> Table:
    t = Table(title=f"Embedding agreement ({res['agreement']['n']} bench prompts)", title_justify="left")
    for col in ("pair", "mean cosine", "min cosine"):
        t.add_column(col, justify="left" if col == "pair" else "right")
    for key, v in res["agreement"].items():
        if isinstance(v, dict):
            t.add_row(key.replace("_", " "), _num(v["mean_cosine"], "{:.4f}"), _num(v["min_cosine"], "{:.4f}"))
    return t


def render(console: Console, res: dict[str, Any]) -> None:
    s = res["settings"]
    console.print(
        _latency_table(
            res,
            "single",
            f"Latency, one prompt at a time, one core (ms; {s['rounds']} rounds x {s['single_per_round']} per cell)",
        )
    )
    console.print(
        _latency_table(
            res,
            "batched",
            f"Latency, micro-batched, one core (ms, submit to result; "
            f"{s['concurrency']} clients, max batch {s['max_batch']})",
        )
    )
    console.print(_throughput_table(res))
    console.print(_agreement_table(res))
    console.print(goals_table(res["goals"]))
    trunc = [
        f"{v['tokens']} -> {v['onnx_kept']} (head+tail; pytorch keeps the first {v['pytorch_kept']})"
        for v in res["truncation"].values()
        if v["onnx_kept"] != v["tokens"]
    ]
    if trunc:
        console.print("truncated prompts: " + "; ".join(trunc))
    share = res["machine"]["other_processes_cpu_share"]
    if share is not None:
        note = " [red](busy machine: numbers are pessimistic)[/]" if share > 0.05 else ""
        console.print(f"other processes used {share:.0%} of the {res['machine']['cores']} cores during the run{note}")
    if kind := res["machine"].get("cpu"):
        console.print(f"CPU: {kind}")
