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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from policies.cascade import YES_NO, Question, TierAnswer


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    split: str
    question: Question
    answer: str
    category: str | None
    embedding: np.ndarray | None = field(default=None, compare=False, repr=False)  # for learned gates


def read_jsonl(path: Path, problems: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Objects with their line numbers. A line that is not a JSON object is skipped; with
    ``problems`` given it is reported there as ``file:line: reason``, else it raises."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                if problems is None:
                    raise
                problems.append(f"{path.name}:{n}: not JSON ({exc.msg})")
                continue
            if not isinstance(doc, dict):
                if problems is None:
                    raise ValueError(f"{path}:{n}: not a JSON object")
                problems.append(f"{path.name}:{n}: not a JSON object")
                continue
            yield n, doc


def _typed(doc: dict[str, Any]) -> tuple[Row | None, str | None]:
    """A row from one typed line, or why it cannot be one."""
    missing = [k for k in ("id", "source", "type", "question", "answer", "split") if not isinstance(doc.get(k), str)]
    if missing:
        return None, f"missing or not a string: {', '.join(missing)}"
    qtype = doc["type"]
    if qtype == "choice":
        options = doc.get("options")
        if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
            return None, "a choice row needs a list of at least two option strings"
        if doc["answer"] not in options:
            return None, f"answer {doc['answer']!r} is not among the options"
        opts: tuple[str, ...] = tuple(options)
    elif qtype == "yes_no":
        if doc["answer"] not in YES_NO:
            return None, f"a yes_no answer is 'yes' or 'no', not {doc['answer']!r}"
        opts = YES_NO
    elif qtype == "score":
        opts = ()
    else:
        return None, f"unknown type {qtype!r}"
    q = Question(qtype, doc["question"], opts, doc.get("context") if isinstance(doc.get("context"), str) else None)
    category = doc.get("category") if isinstance(doc.get("category"), str) else None
    return Row(doc["id"], doc["source"], doc["split"], q, doc["answer"], category), None


def _bucket(key: str) -> float:
    return int.from_bytes(hashlib.sha256(f"triage-eval:{key}".encode()).digest()[:4], "big") / 2**32


def typed_rows(path: Path, split: str, cap: int | None = None, problems: list[str] | None = None) -> list[Row]:
    """Choice, yes/no and numeric rows of one typed file and split; at most ``cap`` of them, a
    seeded sample by hash of the id (the same rows on every machine). A ``score`` row is a number
    with no scale (GSM8K and the like): generation, compared as a number. A line that cannot be a
    row (malformed JSON, a missing field, an answer not among the options, an unknown type) is
    skipped and reported in ``problems`` with its line number; unknown extra fields are ignored."""
    rows, seen = [], set()
    for n, doc in read_jsonl(path, problems if problems is not None else []):
        if doc.get("split") != split:
            continue
        row, why = _typed(doc)
        if row is not None and row.id in seen:
            why = f"duplicate id {row.id!r}"
            row = None
        if row is None:
            if problems is not None:
                problems.append(f"{path.name}:{n}: {why}")
            continue
        seen.add(row.id)
        rows.append(row)
    if cap is not None and len(rows) > cap:
        rows = sorted(rows, key=lambda row: _bucket(row.id))[:cap]
        rows.sort(key=lambda row: row.id)
    return rows


def intent_rows(
    path: Path,
    task: str,
    split: str,
    cap: int | None = None,
    n_options: int = 5,
    text_field: str = "text",
    label_field: str = "label",
) -> list[Row]:
    """Intent rows of a policy task as typed choice questions naming the task ("which of these is
    the request about?"): the gold label and ``n_options - 1`` other labels of the set, chosen and
    ordered by a hash of the row's id (the same on every machine), so that every tier can take them
    (a lettered scorer reads at most 26 options; a 150-way question is the task head's alone). The
    options are the task's labels as they are (the task head answers only its own labels)."""
    every = [d for _, d in read_jsonl(path) if isinstance(d.get(label_field), str)]
    labels = sorted({d[label_field] for d in every})
    docs = [d for d in every if d.get("split") == split]
    rows = []
    for d in docs:
        gold, rid = d[label_field], str(d.get("id"))
        others = sorted((x for x in labels if x != gold), key=lambda x: _bucket(f"{rid}:{x}"))[: n_options - 1]
        options = tuple(sorted([gold, *others], key=lambda x: _bucket(f"{rid}:order:{x}")))
        q = Question("choice", d[text_field], options, None, task)  # the request as the task head reads it
        rows.append(Row(rid, task, split, q, gold, None))
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
                    latency_ms=doc.get("latency_ms", 0.0),
                    error=doc.get("error"),
                    skipped=doc.get("skipped", False),
                    text=doc.get("text"),
                    confidence=doc.get("confidence"),
                    usage=doc.get("usage"),
                )

    def fill(
        self, rows: Iterable[Row], compute: Callable[[Row], TierAnswer], progress: Callable[[], None] | None = None
    ) -> dict[str, TierAnswer]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            for row in rows:
                if row.id not in self.rows:
                    t0 = time.perf_counter()
                    a = compute(row)
                    ms = round(a.latency_ms or (time.perf_counter() - t0) * 1000, 3)  # as stored: a replay is equal
                    a = replace(a, latency_ms=ms)
                    self.rows[row.id] = a
                    out.write(
                        json.dumps(
                            {
                                "id": row.id,
                                "scores": a.scores,
                                "latency_ms": ms,
                                "error": a.error,
                                "skipped": a.skipped,
                                "text": a.text,
                                "confidence": a.confidence,
                                "usage": dict(a.usage) if a.usage else None,
                            }
                        )
                        + "\n"
                    )
                    out.flush()
                if progress is not None:
                    progress()
        return self.rows


def with_embeddings(
    rows: list[Row], path: Path, embed: Callable[[list[str]], np.ndarray], batch: int = 64
) -> list[Row]:
    """``rows`` with their question's embedding (``embed`` on the question text, context first),
    cached in ``path`` (an ``.npz`` of ids and vectors) so that a re-run embeds only new rows."""
    from classifiers.options import question_text

    known: dict[str, np.ndarray] = {}
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            known = dict(zip(z["ids"].tolist(), z["vectors"], strict=True))
    todo = [r for r in rows if r.id not in known]
    for i in range(0, len(todo), batch):
        part = todo[i : i + batch]
        vectors = embed([question_text(r.question.question, r.question.context) for r in part])
        known.update(zip((r.id for r in part), np.asarray(vectors, dtype=np.float32), strict=True))
    if todo:
        path.parent.mkdir(parents=True, exist_ok=True)
        ids = sorted(known)
        np.savez(path, ids=np.array(ids), vectors=np.vstack([known[i] for i in ids]))
    return [replace(r, embedding=known[r.id]) for r in rows]
