"""``triage train``'s learned gates: each cascade tier with ``gate: learned`` gets its confidence
model, fitted on dev rows from the tiers' answers (cached in ``out/cache``, shared with ``triage eval
--out out``), at the policy's own temperatures, and saved where the gateway reads it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval import cascade_eval
from eval.cascade_run import LiveFactory, Progress, Quiet, Rows, Tiers
from policies.schema import Policy


@dataclass(frozen=True)
class GateFit:
    """One learned gate: where its model was saved (None: none could be fitted) and what the fit measured."""

    tier: str
    saved: Path | None
    fit: dict[str, Any]


def learned(pol: Policy) -> list[int]:
    """The cascade's tiers with ``gate: learned``, by index."""
    return [i for i, t in enumerate(pol.cascade.tiers) if t.gate == "learned"] if pol.cascade is not None else []


def fit_gates(
    pol: Policy,
    policy: Path,
    rows: Rows,
    out: Path,
    where: Path,
    progress: Progress | None = None,
    live: LiveFactory | None = None,
) -> list[GateFit]:
    """Each learned gate's model fitted on the dev rows (:func:`eval.cascade_run.load_rows`) and saved
    in ``where``, in the cascade's order; the first that cannot be fitted ends the list (its ``saved`` is None)."""
    assert pol.cascade is not None
    tiers, chosen = pol.cascade.tiers, learned(pol)
    if not chosen:
        return []
    upto = max(chosen) + 1  # the tiers a learned gate reads: itself and those before it
    build = Tiers(pol, policy.resolve().parent, out, [t.name for t in tiers[:upto]], progress or Quiet(), live)
    specs = build.specs(rows)
    for spec, tier in zip(specs, tiers, strict=False):
        spec.temperatures = dict(tier.temperature.items())  # the policy's: the gate reads what the gateway will
    cascade_eval.fit_judges(specs, rows.dev, upto=upto)
    done: list[GateFit] = []
    for i in chosen:
        spec = specs[i]
        if spec.judge is None:
            return [*done, GateFit(spec.name, None, spec.judge_fit)]
        done.append(GateFit(spec.name, spec.judge.save(where), spec.judge_fit))
    return done
