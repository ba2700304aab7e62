"""What the gateway knows of its own quality on live traffic (pure: settings, counts, intervals).

Two sources of evidence, both recorded per answered request of a cascade or routed virtual model:

- **shadow pairs**: a sampled share of the requests answered *below the top* (kept by a cheap
  tier, or routed to a cheaper model) is asked of the top tier (the cascade's last tier, the
  routed model's reference candidate) too, off the request's path; the pair agrees when the two
  answers are the same (a typed decision's option; an open answer's text, or two texts the
  encoder reads as the same);
- **feedback**: a caller's verdict (right / wrong, or a score) on one of its requests.

The headline is the **estimated share of the top's answers kept**: of a slice's N requests, T
were answered by the top itself and K = N - T below it, of which the sampled pairs agree with the
top at a rate a; the slice then gives the top's answer on (T + K a) / N of its requests. Where the
top is right, this is the share of always-top accuracy kept; it counts a cheap answer that
differs from the top's as lost even where the top is the one that is wrong, so it errs low.
The interval is Wilson's on a (the one uncertain part), carried through linearly: K and T are
counted, not sampled. Money saved: what always-top would have cost (the top's cost, measured by
the shadow calls, on the K kept requests, plus what the top's own answers cost) less what was paid.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from policies.strict import Strict

Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


class ShadowSpec(Strict):
    """Shadow checks of a cascade or a routed virtual model: a sampled share of the requests it
    answered below the top is asked of the top too, in the background, at the operator's cost."""

    sample: float = Field(0.05, gt=0, le=1, description="the share of requests answered below the top checked")
    budget_per_day: float = Field(
        gt=0, description="the most the shadow calls may cost in a day (UTC), in the policy's money, per process"
    )
    concurrency: int = Field(2, ge=1, description="shadow calls in flight at once; past it, sampling pauses")
    timeout_s: float = Field(60.0, gt=0, description="a shadow call slower than this is counted as failed")
    reference: str | None = Field(
        None, description="routed models: the candidate that is the top (default: the one with the highest prices)"
    )


class QualitySpec(Strict):
    """Where the records, shadow pairs and feedback live, and when the gateway calls its quality drifting."""

    path: str | None = Field(
        None,
        description="the SQLite file of records (relative to the policy file; default: one per policy in the "
        "triage cache); with state.database set, PostgreSQL instead, shared by the fleet",
    )
    target: float | None = Field(
        None, gt=0, le=1, description="the share of the top's answers to keep: below it (upper bound), drift"
    )
    min_pairs: int = Field(30, ge=1, description="pairs a slice needs before it may be called drifting")
    window_s: float = Field(7 * 86400.0, gt=0, description="the estimates are over the records of this long")
    check_every_s: float = Field(10.0, gt=0, description="how often the estimates are read from the store")
    retention_s: float = Field(30 * 86400.0, gt=0, description="records older than this are deleted")
    mix_recent_s: float = Field(
        3600.0, gt=0, description="the recent traffic whose mix of slices is compared with the window's"
    )
    mix_drift: float = Field(
        0.3, gt=0, le=1, description="a recent mix this far from the window's (total variation) is drift too"
    )
    mix_min_records: int = Field(50, ge=1, description="recent records a model needs before its mix is judged")


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of a rate of k in n (0..1 when n is 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


@dataclass(frozen=True, slots=True)
class Counts:
    """One slice's counts (a model, a question type or '' for routed, and the tier or model that answered)."""

    model: str
    kind: str  # cascade | routed
    answered_by: str
    top: bool
    slice: str
    records: int
    pairs: int = 0
    agree: int = 0
    right: int = 0
    wrong: int = 0
    scored: int = 0
    score_sum: float = 0.0
    shadow_cost: float = 0.0
    cost: float = 0.0


@dataclass(frozen=True, slots=True)
class Estimate:
    model: str
    slice: str  # '' for the whole model
    records: int
    top_share: float  # answered by the top itself
    pairs: int
    agreement: float | None  # of the pairs (None: no pair yet)
    agreement_interval: tuple[float, float]
    of_top: float | None  # the estimated share of the top's answers kept
    of_top_interval: tuple[float, float]
    feedback: int
    feedback_right: float | None  # share of verdicts that said right
    feedback_interval: tuple[float, float]
    mean_score: float | None
    cost: float
    always_top_cost: float | None  # None: no shadow call measured the top's price yet
    saved: float | None
    by_tier: dict[str, dict[str, float | int | None]]

    def as_dict(self) -> dict[str, object]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {
            "model": self.model,
            "slice": self.slice or None,
            "records": self.records,
            "top_share": r(self.top_share),
            "pairs": self.pairs,
            "agreement": r(self.agreement),
            "agreement_interval": [r(x) for x in self.agreement_interval],
            "of_top": r(self.of_top),
            "of_top_interval": [r(x) for x in self.of_top_interval],
            "feedback": self.feedback,
            "feedback_right": r(self.feedback_right),
            "feedback_interval": [r(x) for x in self.feedback_interval],
            "mean_score": r(self.mean_score),
            "cost": r(self.cost),
            "always_top_cost": r(self.always_top_cost),
            "saved": r(self.saved),
            "by_tier": self.by_tier,
        }


def estimate(model: str, slice_: str, rows: Iterable[Counts], z: float = Z95) -> Estimate:
    """The estimate of one model (``slice_`` '') or one of its slices, from its rows' counts."""
    rows = list(rows)
    n = sum(r.records for r in rows)
    top = sum(r.records for r in rows if r.top)
    kept = n - top
    pairs = sum(r.pairs for r in rows)
    agree = sum(r.agree for r in rows)
    a_lo, a_hi = wilson(agree, pairs, z)
    agreement = agree / pairs if pairs else None
    if n == 0:
        of_top, of_lo, of_hi = None, 0.0, 1.0
    elif kept == 0:
        of_top, of_lo, of_hi = 1.0, 1.0, 1.0
    else:
        of_top = (top + kept * agreement) / n if agreement is not None else None
        of_lo, of_hi = (top + kept * a_lo) / n, (top + kept * a_hi) / n
    right, wrong = sum(r.right for r in rows), sum(r.wrong for r in rows)
    scored, score_sum = sum(r.scored for r in rows), sum(r.score_sum for r in rows)
    cost = sum(r.cost for r in rows)
    shadow_cost = sum(r.shadow_cost for r in rows)
    top_cost = sum(r.cost for r in rows if r.top)
    always = top_cost + kept * (shadow_cost / pairs) if pairs else (top_cost if kept == 0 and n else None)
    by_tier: dict[str, dict[str, float | int | None]] = {}
    for tier in sorted({r.answered_by for r in rows}):
        mine = [r for r in rows if r.answered_by == tier]
        tp, ta = sum(r.pairs for r in mine), sum(r.agree for r in mine)
        lo, hi = wilson(ta, tp, z)
        by_tier[tier] = {
            "records": sum(r.records for r in mine),
            "top": any(r.top for r in mine),
            "pairs": tp,
            "agreement": round(ta / tp, 6) if tp else None,
            "agreement_low": round(lo, 6),
            "agreement_high": round(hi, 6),
        }
    return Estimate(
        model,
        slice_,
        n,
        top / n if n else 0.0,
        pairs,
        agreement,
        (a_lo, a_hi),
        of_top,
        (of_lo, of_hi),
        right + wrong,
        right / (right + wrong) if right + wrong else None,
        wilson(right, right + wrong, z),
        score_sum / scored if scored else None,
        cost,
        always,
        always - cost if always is not None else None,
        by_tier,
    )


def estimates(rows: Iterable[Counts]) -> list[Estimate]:
    """Every model's estimate, then each of its slices' (question types; a split's or mirror's ok
    and error) where it has more than one, or where all its records are errors."""
    rows = list(rows)
    out: list[Estimate] = []
    for model in sorted({r.model for r in rows}):
        mine = [r for r in rows if r.model == model]
        out.append(estimate(model, "", mine))
        slices = sorted({r.slice for r in mine if r.slice})
        if len(slices) > 1 or slices == ["error"]:  # a mirror's or split's failures are a slice of their own
            out.extend(estimate(model, s, [r for r in mine if r.slice == s]) for s in slices)
    return out


@dataclass(frozen=True, slots=True)
class Drift:
    model: str
    slice: str
    reason: str
    kind: str = "quality"  # quality: the estimate under the target; mix: the traffic moved

    @property
    def label(self) -> str:
        return f"{self.model}/{self.slice}" if self.slice else self.model


def quality_drift(found: Iterable[Estimate], target: float | None, min_pairs: int) -> list[Drift]:
    """The slices whose interval's upper bound of the share of the top's answers kept is below
    ``target``, once they have ``min_pairs`` pairs."""
    if target is None:
        return []
    return [
        Drift(
            e.model,
            e.slice,
            f"the share of the top's answers kept is at most {e.of_top_interval[1]:.3f} "
            f"(estimate {e.of_top:.3f}, {e.pairs} pairs), under the target {target:.3f}",
        )
        for e in found
        if e.pairs >= min_pairs and e.of_top is not None and e.of_top_interval[1] < target
    ]


def question_doc(qtype: str, question: str, options: tuple[str, ...], context: str | None) -> str:
    """A typed question as a record keeps it (where prompts may be logged): enough to ask it again."""
    return json.dumps({"type": qtype, "question": question, "options": list(options), "context": context})


def labeled_rows(exported: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Recorded typed decisions as rows of a labeled set (``triage eval --data``, ``triage
    calibrate``): the label is the top's answer from the shadow check, or the kept answer where the
    caller said it was right. Only records whose question was kept (``logging.log_prompts``) and
    that have a label; the split is dev or test by the request id's hash (half each)."""
    rows = []
    for r in exported:
        try:
            doc = json.loads(r.get("prompt") or "")
        except json.JSONDecodeError:
            continue
        if not isinstance(doc, dict) or doc.get("type") not in ("choice", "yes_no", "score"):
            continue
        if r.get("verdict") == "right" and r.get("kept") is not None:
            answer, label = r["kept"], "feedback"
        elif r.get("top_answer") is not None:
            answer, label = r["top_answer"], "top"
        else:
            continue
        rid = str(r["request_id"])
        split = "dev" if int(hashlib.sha256(rid.encode()).hexdigest()[:8], 16) % 2 == 0 else "test"
        rows.append(
            {
                "id": f"traffic-{rid}",
                "source": f"traffic:{r['model']}",
                "type": doc["type"],
                "question": doc["question"],
                "context": doc.get("context"),
                "options": doc.get("options") or [],
                "answer": answer,
                "category": None,
                "split": split,
                "label_from": label,
                "answered_by": r.get("answered_by"),
            }
        )
    return rows


def mix(rows: Iterable[Counts]) -> dict[str, dict[str, int]]:
    """Per model, its records per slice."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        by = out.setdefault(r.model, {})
        by[r.slice] = by.get(r.slice, 0) + r.records
    return out


def mix_drift(
    window: dict[str, dict[str, int]], recent: dict[str, dict[str, int]], threshold: float, min_records: int
) -> list[Drift]:
    """Models whose recent traffic's mix of slices (question types) is at least ``threshold`` away
    (total variation) from the whole window's, once the recent traffic has ``min_records``: the
    traffic the thresholds were set on is not the traffic now."""
    out = []
    for model, now in sorted(recent.items()):
        n, before = sum(now.values()), window.get(model, {})
        total = sum(before.values())
        if n < min_records or total <= n:
            continue
        # the window less the recent part: what the traffic was before
        past = {s: before.get(s, 0) - now.get(s, 0) for s in {*before, *now}}
        rest = sum(past.values())
        if rest <= 0:
            continue
        tv = 0.5 * sum(abs(now.get(s, 0) / n - past.get(s, 0) / rest) for s in past)
        if tv >= threshold:
            shares = ", ".join(f"{s or 'all'} {now.get(s, 0) / n:.0%}" for s in sorted(past))
            out.append(
                Drift(model, "", f"the recent mix of question types ({shares}) moved {tv:.2f} from before", "mix")
            )
    return out
