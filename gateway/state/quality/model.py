"""The live-traffic quality store's model: what its engines (``sqlite.py``, ``pg.py``) share, the
three kinds of rows and the statements both run. No I/O.

Text is kept without NUL characters: PostgreSQL's text cannot hold one, and rather than refuse a
request's record (written in the background, long after its answer) both engines strip them
(:func:`clean`), so the two keep the same text. An id or owner holding a NUL matches nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RECORD_COLUMNS = ("request_id", "at", "owner", "model", "kind", "answered_by", "top", "slice", "cost", "prompt")
PAIR_COLUMNS = ("request_id", "at", "kept", "top_answer", "agree", "cost")
EXPORT_COLUMNS = (*RECORD_COLUMNS, "kept", "top_answer", "agree", "verdict", "score")
GROUP = ("model", "kind", "answered_by", "top", "slice")


@dataclass(frozen=True, slots=True)
class Record:
    """One answered request of a tracked model."""

    request_id: str
    at: float  # unix seconds
    owner: str | None  # the caller key's sha256 (None: the gateway runs without keys)
    model: str  # the virtual model the request named
    kind: str  # "cascade" | "routed"
    answered_by: str  # the cascade tier's name, or the routed model's chosen model
    top: bool  # answered by the top tier / the reference model itself
    slice: str  # the question type for a cascade ("choice", "yes_no", "score"), "" for routed
    cost: float  # what the request's answer cost, in the policy's money
    prompt: str | None = None  # the question text, only where the policy allows logging prompts


@dataclass(frozen=True, slots=True)
class Pair:
    """A shadow check of one record."""

    request_id: str
    at: float
    kept: str  # the answer the caller got
    top_answer: str  # the top tier's answer to the same request
    agree: bool
    cost: float  # what the shadow call cost (the operator's money)


@dataclass(frozen=True, slots=True)
class SliceCounts:
    """One row of the summary: the records of one (model, kind, answered_by, top, slice)."""

    model: str
    kind: str
    answered_by: str
    top: bool
    slice: str
    records: int
    pairs: int
    agree: int
    right: int  # feedback verdicts "right"
    wrong: int  # feedback verdicts "wrong"
    scored: int  # feedback with a score
    score_sum: float
    shadow_cost: float
    cost: float  # sum of the records' cost


def clean(text: str | None) -> str | None:
    """``text`` without NUL characters (PostgreSQL's text cannot hold one; SQLite keeps the same)."""
    return None if text is None else text.replace("\x00", "")


def record_row(r: Record) -> tuple[Any, ...]:
    """A record's values, in :data:`RECORD_COLUMNS` order, its text cleaned."""
    return (
        clean(r.request_id),
        r.at,
        clean(r.owner),
        clean(r.model),
        clean(r.kind),
        clean(r.answered_by),
        r.top,
        clean(r.slice),
        r.cost,
        clean(r.prompt),
    )


def pair_row(p: Pair) -> tuple[Any, ...]:
    """A pair's values, in :data:`PAIR_COLUMNS` order, its text cleaned."""
    return (clean(p.request_id), p.at, clean(p.kept), clean(p.top_answer), p.agree, p.cost)


def slice_counts(row: Sequence[Any]) -> SliceCounts:
    """A summary row as both engines select it: the :data:`GROUP` columns, then the sums in field order."""
    model, kind, answered_by, top, slice_ = row[:5]
    records, pairs, agree, right, wrong, scored = (int(v) for v in row[5:11])
    score_sum, shadow_cost, cost = (float(v) for v in row[11:])
    return SliceCounts(
        model,
        kind,
        answered_by,
        bool(top),
        slice_,
        records,
        pairs,
        agree,
        right,
        wrong,
        scored,
        score_sum,
        shadow_cost,
        cost,
    )


def export_row(row: Sequence[Any]) -> dict[str, Any]:
    """An exported row as both engines select it (:data:`EXPORT_COLUMNS`), booleans as booleans."""
    out = dict(zip(EXPORT_COLUMNS, row, strict=True))
    out["top"] = bool(out["top"])
    out["agree"] = None if out["agree"] is None else bool(out["agree"])
    return out


def counts_select(since: str) -> str:
    """The summary's SELECT, for either engine (``since``: its placeholder), without its ORDER BY."""
    group = ", ".join(f"r.{c}" for c in GROUP)
    return (
        f"SELECT {group}, count(*), count(p.request_id), coalesce(sum(CASE WHEN p.agree THEN 1 ELSE 0 END), 0),"
        " coalesce(sum(CASE WHEN f.verdict = 'right' THEN 1 ELSE 0 END), 0),"
        " coalesce(sum(CASE WHEN f.verdict = 'wrong' THEN 1 ELSE 0 END), 0),"
        " count(f.score), coalesce(sum(f.score), 0), coalesce(sum(p.cost), 0), coalesce(sum(r.cost), 0)"
        " FROM quality_records r"
        " LEFT JOIN quality_pairs p ON p.request_id = r.request_id"
        " LEFT JOIN quality_feedback f ON f.request_id = r.request_id"
        f" WHERE r.at >= {since} GROUP BY {group}"
    )


EXPORT_SELECT = (
    "SELECT "
    + ", ".join(f"r.{c}" for c in RECORD_COLUMNS)
    + ", p.kept, p.top_answer, p.agree, f.verdict, f.score FROM quality_records r"
    " LEFT JOIN quality_pairs p ON p.request_id = r.request_id"
    " LEFT JOIN quality_feedback f ON f.request_id = r.request_id"
    " WHERE (p.request_id IS NOT NULL OR f.request_id IS NOT NULL)"
)
