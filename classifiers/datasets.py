"""Labeled text for the built-in heads, read from the shared data layout (see its README).

Each recipe returns ``Rows``: texts, labels and stable ids, for one split. Typed questions are
rendered the way they reach the gateway in a chat message: context, question, lettered options.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LETTERS = "ABCDEFGHIJKLMNOP"
QUESTION_TYPES = ("choice", "yes_no", "score", "open")

TYPED_FILES = (
    "mmlu_pro",
    "mmlu_redux",
    "boolq",
    "strategyqa",
    "commonsenseqa",
    "openbookqa",
    "piqa",
    "siqa",
    "logiqa",
    "hellaswag",
    "truthfulqa_mc1",
    "gsm8k",
    "svamp",
    "multiarith",
)
OPEN_FILES = ("mt_bench", "arena_hard_v0.1")
SHAPED = "shaped-"  # the id prefix of shaped_choice rows


@dataclass
class Rows:
    texts: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def add(self, text: str, label: str, id_: str) -> None:
        self.texts.append(text)
        self.labels.append(label)
        self.ids.append(id_)

    def __len__(self) -> int:
        return len(self.texts)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def find(data_dir: Path, folder: str, name: str) -> Path:
    for suffix in (".jsonl", ".jsonl.gz"):
        path = data_dir / folder / f"{name}{suffix}"
        if path.is_file():
            return path
    raise FileNotFoundError(f"no {folder}/{name}.jsonl[.gz] under {data_dir}")


def render_typed(row: dict[str, Any]) -> str:
    parts = [row["context"]] if row.get("context") else []
    parts.append(row["question"])
    if row["type"] == "choice" and row.get("options"):
        parts.append("\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(row["options"])))
    return "\n\n".join(parts)


_LAYOUTS = (
    lambda i, o: f"{LETTERS[i]}. {o}",
    lambda i, o: f"{LETTERS[i]}) {o}",
    lambda i, o: f"({LETTERS[i].lower()}) {o}",
    lambda i, o: f"{LETTERS[i]}: {o}",
    lambda i, o: f"{i + 1}. {o}",
)
_ASKS = ("", "", "Answer with the letter of the correct option.", "Choose one: {letters}.", "Which option is right?")


def shaped_choice(row: dict[str, Any]) -> str:
    """A choice row as other sources and clients shape it: two to five of its options (the answer
    kept, order shuffled), lettered or numbered, on lines or inline, with or without an ask.

    MMLU-Pro's ten options on lines are one shape only; a head trained on it alone reads
    two-option (PIQA) or long-option (HellaSwag) questions as open. Every choice is a SHA-256 of
    the row's id, so the rows are the same on every run."""

    def pick(what: str, n: int) -> int:
        return int.from_bytes(hashlib.sha256(f"shaped:{row['id']}:{what}".encode()).digest()[:4], "big") % n

    answer = row.get("answer")
    others = sorted((o for o in row["options"] if o != answer), key=lambda o: _bucket(f"{row['id']}:{o}", "shaped"))
    k = 2 + pick("k", 4)
    chosen = others[: k - 1] + ([answer] if answer in row["options"] else others[k - 1 : k])
    chosen.sort(key=lambda o: _bucket(f"{row['id']}:{o}", "shaped-order"))
    layout = _LAYOUTS[pick("layout", len(_LAYOUTS))]
    lines = [layout(i, o) for i, o in enumerate(chosen)]
    body = " ".join(lines) if pick("inline", 4) == 0 else "\n".join(lines)
    ask = _ASKS[pick("ask", len(_ASKS))].format(letters=", ".join(LETTERS[: len(chosen)]))
    question = "\n\n".join(p for p in (row.get("context"), row["question"]) if p)
    return "\n\n".join(p for p in (question, body, ask) if p)


def source_of(id_: str) -> str:
    """The set a question-type row comes from, by its id (``piqa-test-3`` -> ``piqa``); open prompts: ``open``."""
    name = id_.removeprefix(SHAPED).split("-")[0]
    return "open" if name in OPEN_FILES else (f"{SHAPED}{name}" if id_.startswith(SHAPED) else name)


def _bucket(id_: str, salt: str) -> float:
    return int.from_bytes(hashlib.sha256(f"{salt}:{id_}".encode()).digest()[:4], "big") / 2**32


def subsample(rows: Rows, cap: int, salt: str) -> Rows:
    """At most ``cap`` rows, chosen by a seeded hash of their ids, in their original order."""
    if len(rows) <= cap:
        return rows
    order = sorted(range(len(rows)), key=lambda i: _bucket(rows.ids[i], salt))[:cap]
    out = Rows()
    for i in sorted(order):
        out.add(rows.texts[i], rows.labels[i], rows.ids[i])
    return out


def _open_split(id_: str) -> str:
    # open prompts have no split upstream: a seeded 30% is test, the rest dev
    return "test" if _bucket(id_, "triage-open-split") < 0.3 else "dev"


def question_type(data_dir: Path, split: str, per_source_cap: int = 1200, shaped: bool = False) -> Rows:
    """Typed rows labeled by type, and open prompts. ``shaped``: the split's MMLU-Pro rows left out by
    ``per_source_cap`` come in too, each once, as :func:`shaped_choice` renders it."""
    out = Rows()
    for name in TYPED_FILES:
        try:
            path = find(data_dir, "typed", name)
        except FileNotFoundError:
            continue
        rows, left = Rows(), []
        every = [row for row in read_jsonl(path) if row["split"] == split]
        for row in every:
            rows.add(render_typed(row), row["type"], row["id"])
        rows = subsample(rows, per_source_cap, f"qtype-{name}")
        for t, y, i in zip(rows.texts, rows.labels, rows.ids, strict=True):
            out.add(t, y, i)
        if shaped and name == "mmlu_pro":
            kept = set(rows.ids)
            left = [row for row in every if row["id"] not in kept and len(row.get("options") or []) >= 2]
        for row in left:
            out.add(shaped_choice(row), "choice", f"{SHAPED}{row['id']}")
    for name in OPEN_FILES:
        for row in read_jsonl(find(data_dir, "open", name)):
            if _open_split(row["id"]) == split:
                out.add(row["prompt"], "open", row["id"])
    return out


def category(data_dir: Path, split: str) -> Rows:
    out = Rows()
    for row in read_jsonl(find(data_dir, "typed", "mmlu_pro")):
        if row["split"] == split:
            out.add(render_typed(row), row["category"], row["id"])
    return out


def reasoning(data_dir: Path, split: str) -> Rows:
    """Label ``pays`` where chain-of-thought was right and the direct answer wrong.

    BIG-Bench-Hard rows are all ``dev`` upstream; a seeded 30% of them is held out as test.
    """
    out = Rows()
    for row in read_jsonl(find(data_dir, "reasoning", "bbh_cot_vs_direct")):
        row_split = "test" if _bucket(row["id"], "triage-bbh-split") < 0.3 else "dev"
        if row_split == split:
            out.add(row["prompt"], "pays" if row["cot_correct"] and not row["direct_correct"] else "no", row["id"])
    return out


def task(path: Path, split: str, text_field: str = "text", label_field: str = "label") -> Rows:
    out = Rows()
    for row in read_jsonl(path):
        if row.get("split") == split:
            out.add(row[text_field], str(row[label_field]), row.get("id") or f"{path.stem}-{len(out)}")
    return out
