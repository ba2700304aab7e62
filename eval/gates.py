"""``--fail-under``: regression gates over an eval report, for CI. Pure.

``accuracy=0.8,ece=0.05`` fails when any set's cascade accuracy is under 0.8 or any tier's ECE
(after calibration) on any set is over 0.05. Keys: ``accuracy`` (at least, per set), ``apgr``
(at least, per set with a curve), ``ece`` (at most, per set and tier), ``escalation`` (at most:
the share past the first tier, per set).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from eval.cascade_eval import SetReport

KEYS = ("accuracy", "apgr", "ece", "escalation")


def parse(spec: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in KEYS:
            raise ValueError(f"'{part}': expected KEY=NUMBER with KEY one of {', '.join(KEYS)}")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"'{part}': {value!r} is not a number") from None
    return out


def failures(reports: Sequence[SetReport], limits: dict[str, float]) -> list[str]:
    """Every gate a report misses, as readable lines; empty when all hold."""
    out = []
    for r in reports:
        where = f"{r.source} ({r.qtype})"
        if "accuracy" in limits and not r.cascade >= limits["accuracy"]:
            out.append(f"{where}: accuracy {r.cascade:.3f} < {limits['accuracy']}")
        if "escalation" in limits and r.past_first > limits["escalation"]:
            out.append(f"{where}: escalation {r.past_first:.3f} > {limits['escalation']}")
        if "apgr" in limits and math.isfinite(r.curve.apgr) and r.curve.apgr < limits["apgr"]:
            out.append(f"{where}: APGR {r.curve.apgr:.3f} < {limits['apgr']}")
        if "ece" in limits:
            out += [
                f"{where}: ECE of {tier} {value:.3f} > {limits['ece']}"
                for tier, value in r.ece.items()
                if math.isfinite(value) and value > limits["ece"]
            ]
    return out
