"""The cascade's memory of escalations (issue 56, Inter-Cascade's lever): the top tier's answers to
typed questions, kept in a bounded ring keyed by the encoder's embedding, and given back to a cheap
tier as solved examples in its prompt when a new question is close to them. Pure (numpy only);
one per gateway, kept in step across a fleet by ``gateway/state/memory_redis.py``.

A question is remembered when the cascade's last tier answered it (an escalation) or a shadow check
asked the last tier of it; the same question again (type, text, options, context) replaces its
entry. :meth:`Memory.nearest` returns up to ``n`` entries of the same question type whose cosine
similarity reaches ``min_similarity``, nearest first; :func:`with_examples` puts them before the
question's own context, as a tier with ``examples: true`` is asked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from policies.cascade import Question

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class Example:
    question: Question
    answer: str
    similarity: float


def _key(q: Question) -> tuple[object, ...]:
    return (q.type, q.question, q.options, q.context, q.scale)


class Memory:
    """A ring of at most ``size`` answered questions, each with its unit-length embedding."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a memory holds at least one question")
        self.size = size
        self._vectors: np.ndarray | None = None
        self._items: list[tuple[Question, str] | None] = [None] * size
        self._where: dict[tuple[object, ...], int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._where)

    def add(self, embedding: np.ndarray, q: Question, answer: str) -> None:
        v = np.asarray(embedding, dtype=np.float32).ravel()
        norm = float(np.linalg.norm(v))
        if norm == 0.0 or not np.isfinite(norm):
            return
        if self._vectors is None:
            self._vectors = np.zeros((self.size, v.size), dtype=np.float32)
        if v.size != self._vectors.shape[1]:
            raise ValueError(f"an embedding of {v.size} values, the memory's are {self._vectors.shape[1]}")
        key = _key(q)
        slot = self._where.get(key)
        if slot is None:
            slot = self._next
            self._next = (self._next + 1) % self.size
            old = self._items[slot]
            if old is not None:
                del self._where[_key(old[0])]
        self._vectors[slot] = v / norm
        self._items[slot] = (q, answer)
        self._where[key] = slot

    def nearest(self, embedding: np.ndarray, q: Question, n: int, min_similarity: float) -> list[Example]:
        """Up to ``n`` remembered questions of ``q``'s type (not ``q`` itself), nearest first."""
        if self._vectors is None or n < 1 or not self._where:
            return []
        v = np.asarray(embedding, dtype=np.float32).ravel()
        norm = float(np.linalg.norm(v))
        if norm == 0.0 or not np.isfinite(norm) or v.size != self._vectors.shape[1]:
            return []
        sims = self._vectors @ (v / norm)
        own = self._where.get(_key(q))
        out: list[Example] = []
        for slot in np.argsort(-sims):
            item = self._items[int(slot)]
            if sims[slot] < min_similarity or len(out) == n:
                break
            if item is None or int(slot) == own or item[0].type != q.type:
                continue
            out.append(Example(item[0], item[1], float(sims[slot])))
        return out


def render(examples: list[Example]) -> str:
    """The examples as solved questions: each question, its options lettered, and the answer."""
    parts = []
    for e in examples:
        lines = [f"Question: {e.question.question}"]
        if e.question.type == "choice":
            lines += [f"{LETTERS[i]}. {o}" for i, o in enumerate(e.question.options[: len(LETTERS)])]
        lines.append(f"Answer: {e.answer}")
        parts.append("\n".join(lines))
    return "Solved questions like this one:\n\n" + "\n\n".join(parts)


def with_examples(q: Question, examples: list[Example]) -> Question:
    """``q`` with the examples before its own context."""
    if not examples:
        return q
    shown = render(examples)
    return dataclasses.replace(q, context=shown if not q.context else f"{shown}\n\n{q.context}")
