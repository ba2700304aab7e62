"""The tables ``python -m benchmarks hidden-probe``'s run prints (``benchmarks/hidden_probe.py``)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.hidden_probe import GATE_AUROC, GOAL


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print(console: Console, res: dict[str, Any]) -> None:
    t = res["test"]
    iv = t["pooled_interval_95"]
    table = Table(title="Right/wrong AUROC of the scorer's answers (test rows; fits on dev rows)")
    for col in ("set", "test rows", "accuracy", "(a) top prob", "(a) gate scale", "(b) hidden probe", "(c) (b)+conf"):
        table.add_column(col, justify="left" if col == "set" else "right")
    for name, s in t["per_set"].items():
        a = s["auroc"]
        table.add_row(
            name,
            str(s["test_rows"]),
            f"{s['accuracy']:.2f}",
            _f(a["a_top_prob"]),
            _f(a["a_gate_scale"]),
            _f(a["b_hidden_probe"]),
            _f(a["c_probe_plus_conf"]),
        )

    def cell(k: str) -> str:
        return f"{_f(t['pooled_auroc'][k])} [{iv[k]['lo']:.3f}, {iv[k]['hi']:.3f}]"

    r = res["rows"]
    table.add_row(
        "pooled",
        str(r["test_used"]),
        _f(r["test_share_right"]),
        cell("a_top_prob"),
        cell("a_gate_scale"),
        cell("b_hidden_probe"),
        cell("c_probe_plus_conf"),
        style="bold",
    )
    console.print(table)
    for k in ("b_hidden_probe", "c_probe_plus_conf", "a_gate_scale"):
        d = iv[k]
        console.print(
            f"{k} - a_top_prob, pooled: {d['diff_vs_a_top_prob']:+.3f} [{d['diff_lo']:+.3f}, {d['diff_hi']:+.3f}]"
        )
    console.print(
        f"set's dev accuracy alone, pooled: {_f(t['pooled_auroc']['set_dev_accuracy'])}; "
        f"ECE of (c) {t['ece_c']:.3f}, of (b) {t['ece_b']:.3f}, of (a) {t['ece_a_top_prob']:.3f}"
    )
    f, tm, ck = res["fits"], res["timings"], res["one_pass_check"]
    console.print(
        f"C: (b) {f['b_hidden_probe']['C']}, (c) {f['c_probe_plus_conf']['C']}; rows dev {r['dev_used']}, "
        f"test {r['test_used']}, skipped {r['skipped']}; {tm['seconds_per_row_mean']:.2f} s a row "
        f"(p50 {tm['seconds_per_row_p50']:.2f})"
    )
    if ck["rows"]:
        console.print(
            f"one pass vs embedding mode off, {ck['rows']} rows: same answer {ck['same_answer']:.3f}, "
            f"largest probability difference {ck['max_abs_prob_diff']:.2e}, {ck['seconds_plain_mean']:.2f} s "
            f"off vs {ck['seconds_embedding_mean']:.2f} s on"
        )
    if res["settings"]["layers"]:
        _print_layers(console, res)
    console.print(
        f"the learned gate's {GATE_AUROC} (docs/benchmarks.md; goal >= {GOAL}) is from another run on other "
        "rows: not comparable row for row"
    )


def _print_layers(console: Console, res: dict[str, Any]) -> None:
    t, fits = res["test"], res["fits"]
    iv, pooled = t["pooled_interval_95"], t["pooled_auroc"]
    keys = ["a_top_prob", "b_hidden_probe"]
    keys += [f"layer_{il}_probe" for il in res["settings"]["layers"]] + ["layers_concat_plus_conf"]
    table = Table(title="Probes by layer: right/wrong AUROC on the test rows (fits on dev rows)")
    for col in ("score", "pooled [95%]", "- top prob [95%]", "C", *t["per_set"]):
        table.add_column(col, justify="left" if col == "score" else "right")
    for k in keys:
        d = iv[k]
        diff = "" if k == "a_top_prob" else f"{d['diff_vs_a_top_prob']:+.3f} [{d['diff_lo']:+.3f}, {d['diff_hi']:+.3f}]"
        table.add_row(
            k,
            f"{_f(pooled[k])} [{d['lo']:.3f}, {d['hi']:.3f}]",
            diff,
            str(fits[k]["C"]) if k in fits else "",
            *(_f(s["auroc"][k]) for s in t["per_set"].values()),
        )
    console.print(table)
    lp = res["layer_pass"]
    if lp and lp["rows"]:
        console.print(
            f"layer pass, {lp['rows']} rows: same answer as cached {lp['same_answer']:.3f}, largest probability "
            f"difference {lp['max_abs_prob_diff']:.2e}, {lp['seconds_per_row_mean']:.2f} s a row "
            f"(p50 {lp['seconds_per_row_p50']:.2f})"
        )
