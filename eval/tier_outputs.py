"""Each tier's raw output per labeled row, computed once and cached on disk.

A cache file holds one JSON line per row (``id``, ``scores`` or ``text``, ``latency_ms``, ``error``),
keyed by the tier, its model and its prompt template version, so a re-run with other thresholds
or another top tier calls no model, and an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.cascade import YES_NO, Question, TierAnswer


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    split: str
    question: Question
    answer: str
    category: str | None


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        for n, line in enumerate(f, 1):
            if line.strip():
                yield n, json.loads(line)


def _bucket(key: str) -> float:
    return int.from_bytes(hashlib.sha256(f"triage-eval:{key}".encode()).digest()[:4], "big") / 2**32


def typed_rows(path: Path, split: str, cap: int | None = None) -> list[Row]:
    """Choice, yes/no and numeric rows of one typed file and split; at most ``cap`` of them, a
    seeded sample by hash of the id (the same rows on every machine). A ``score`` row is a number
    with no scale (GSM8K and the like): generation, compared as a number."""
    rows = []
    for _, r in read_jsonl(path):
        if r.get("split") != split or r.get("type") not in ("choice", "yes_no", "score"):
            continue
        options = tuple(r["options"]) if r["type"] == "choice" else YES_NO if r["type"] == "yes_no" else ()
        q = Question(r["type"], r["question"], options, r.get("context"))
        rows.append(Row(r["id"], r["source"], split, q, r["answer"], r.get("category")))
    if cap is not None and len(rows) > cap:
        rows = sorted(rows, key=lambda row: _bucket(row.id))[:cap]
        rows.sort(key=lambda row: row.id)
    return rows


class TierCache:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[str, TierAnswer] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by an interrupted run: computed again
                self.rows[doc["id"]] = TierAnswer(
                    scores=tuple(doc["scores"]) if doc.get("scores") is not None else None,
                    latency_ms=doc.get("latency_ms", 0.0), error=doc.get("error"), skipped=doc.get("skipped", False),
                    text=doc.get("text"), confidence=doc.get("confidence"))

    def fill(self, rows: Iterable[Row], compute: Callable[[Row], TierAnswer],
             progress: Callable[[], None] | None = None) -> dict[str, TierAnswer]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            for row in rows:
                if row.id not in self.rows:
                    t0 = time.perf_counter()
                    a = compute(row)
                    ms = round(a.latency_ms or (time.perf_counter() - t0) * 1000, 3)  # as stored: a replay is equal
                    a = TierAnswer(a.scores, ms, a.error, a.skipped, a.text, a.confidence)
                    self.rows[row.id] = a
                    out.write(json.dumps({"id": row.id, "scores": a.scores, "latency_ms": ms,
                                          "error": a.error, "skipped": a.skipped, "text": a.text,
                                          "confidence": a.confidence}) + "\n")
                    out.flush()
                if progress is not None:
                    progress()
        return self.rows
