"""Rollouts: mirrors and the guard of a split (pure: settings and the guard's verdict).

- A **mirror** (policy: ``mirrors``, keyed by the model name a request names) copies a sampled share
  of that name's answered requests to a candidate model in the background: the caller's answer is
  the primary's, the candidate's call is the operator's (no key is charged), under a budget per day
  and a cap on calls in flight, as a shadow check is. Each mirrored request leaves a record and a
  pair in the quality store (``mirror:<name>``: the primary's answer beside the candidate's, and
  whether the two agree), its latency and errors in the quality watch's counters and metrics.
- A **guard** on a ``split`` virtual model moves a candidate's weight back to the primary when, over
  the guard's window, the candidate's error rate is above ``max_error_rate`` at the lower bound of
  its 95% interval, or its agreement with the primary (the split's shadow checks: the candidate's
  answers asked of the primary too) is under ``min_agreement`` at the upper bound of its interval.
  The evidence is the quality store's (shared by a fleet on PostgreSQL), so every gateway reading
  it reaches the same verdict within one ``quality.check_every_s``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import Field

from policies.quality import Counts, wilson
from policies.strict import Strict

OK, ERROR = "ok", "error"  # a split record's slice: how the request ended
SPLIT, MIRROR = "split", "mirror"  # the records' kinds


class MirrorSpec(Strict):
    """A share of a model name's traffic copied to a candidate, off the request's path."""

    to: str = Field(description="the candidate model asked the same request (a policy model)")
    sample: float = Field(0.1, gt=0, le=1, description="the share of answered requests copied")
    budget_per_day: float = Field(
        gt=0, description="the most the candidate's calls may cost in a day (UTC), in the policy's money, per process"
    )
    concurrency: int = Field(2, ge=1, description="mirrored calls in flight at once; past it, copying pauses")
    timeout_s: float = Field(60.0, gt=0, description="a mirrored call slower than this is counted as failed")


class GuardSpec(Strict):
    """When a split's candidate is rolled back to its primary."""

    primary: str | None = Field(None, description="the target kept when a candidate fails (default: the heaviest)")
    max_error_rate: float = Field(
        0.05, gt=0, lt=1, description="a candidate whose error rate is above this (95% lower bound) is rolled back"
    )
    min_agreement: float | None = Field(
        None,
        gt=0,
        le=1,
        description="a candidate whose agreement with the primary is under this (95% upper bound) is rolled back; "
        "needs the split's `shadow`",
    )
    min_requests: int = Field(20, ge=1, description="a candidate's requests (or pairs) before it may be judged")
    window_s: float = Field(3600.0, gt=0, description="the evidence is the candidate's traffic over this long")


def primary_of(targets: Iterable[tuple[str, float]], guard: GuardSpec | None) -> str:
    """The split's primary: the guard's, else the heaviest target (the first of the heaviest)."""
    if guard is not None and guard.primary is not None:
        return guard.primary
    best: tuple[str, float] | None = None
    for t in targets:
        if best is None or t[1] > best[1]:
            best = t
    assert best is not None, "validated: a split has a target"
    return best[0]


def signature(targets: Iterable[tuple[str, float]]) -> str:
    """What identifies one setting of a split's weights: a rollback holds until it changes."""
    text = "|".join(f"{t}={w!r}" for t, w in targets)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


@dataclass(frozen=True, slots=True)
class Rollback:
    split: str
    target: str
    reason: str
    requests: int
    errors: int
    pairs: int
    agree: int


def verdict(split: str, guard: GuardSpec, primary: str, rows: Iterable[Counts]) -> list[Rollback]:
    """The candidates of ``split`` to roll back, from its records' counts over the guard's window
    (each row one target, ``answered_by``, and one outcome, ``slice``)."""
    by: dict[str, list[Counts]] = {}
    for r in rows:
        if r.model == split and r.kind == SPLIT and r.answered_by != primary:
            by.setdefault(r.answered_by, []).append(r)
    out = []
    for target, mine in sorted(by.items()):
        n = sum(r.records for r in mine)
        errors = sum(r.records for r in mine if r.slice == ERROR)
        pairs, agree = sum(r.pairs for r in mine), sum(r.agree for r in mine)
        reason = None
        if n >= guard.min_requests and wilson(errors, n)[0] > guard.max_error_rate:
            reason = f"error rate {errors}/{n}: at least {wilson(errors, n)[0]:.3f}, above {guard.max_error_rate:g}"
        elif guard.min_agreement is not None and pairs >= guard.min_requests:
            high = wilson(agree, pairs)[1]
            if high < guard.min_agreement:
                reason = f"agreement with {primary} {agree}/{pairs}: at most {high:.3f}, under {guard.min_agreement:g}"
        if reason is not None:
            out.append(Rollback(split, target, reason, n, errors, pairs, agree))
    return out


def without(targets: tuple[tuple[str, float], ...], gone: Iterable[str], primary: str) -> tuple[tuple[str, float], ...]:
    """``targets`` with each rolled-back one's share given to the primary, in its place: a caller
    it held now gets the primary, and every other caller keeps its target (the split stays sticky)."""
    dropped = set(gone)
    return tuple((primary if t in dropped else t, w) for t, w in targets) if dropped else targets
