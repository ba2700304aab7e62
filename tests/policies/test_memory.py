"""The cascade's memory of escalations (policies/memory.py): a bounded ring keyed by embeddings,
the nearest questions of the same type, and the examples as a tier's prompt shows them."""

from __future__ import annotations

import numpy as np
import pytest

from policies.cascade import Question
from policies.memory import Memory, with_examples


def q(text: str, qtype: str = "choice") -> Question:
    return Question(qtype, text, ("red", "blue") if qtype == "choice" else ("yes", "no"))  # type: ignore[arg-type]


def unit(*v: float) -> np.ndarray:
    return np.array(v, dtype=np.float32)


def test_the_nearest_of_the_same_type_above_the_similarity_nearest_first() -> None:
    m = Memory(10)
    m.add(unit(1, 0, 0), q("sky?"), "blue")
    m.add(unit(0.9, 0.1, 0), q("sea?"), "blue")
    m.add(unit(0, 1, 0), q("blood?"), "red")
    m.add(unit(1, 0, 0), q("is it?", "yes_no"), "yes")
    got = m.nearest(unit(1, 0.05, 0), q("lake?"), 5, 0.5)
    assert [e.question.question for e in got] == ["sky?", "sea?"]  # blood is too far, the yes/no of another type
    assert got[0].similarity == pytest.approx(1 / np.sqrt(1 + 0.05**2), abs=1e-4)
    assert m.nearest(unit(1, 0, 0), q("lake?"), 1, 0.5)[0].question.question == "sky?"
    assert m.nearest(unit(1, 0, 0), q("sky?"), 5, 0.5)[0].question.question == "sea?"  # never the question itself
    assert m.nearest(unit(0, 0, 0), q("lake?"), 5, 0.0) == []


def test_the_ring_is_bounded_and_the_same_question_replaces_its_entry() -> None:
    m = Memory(2)
    m.add(unit(1, 0), q("a?"), "red")
    m.add(unit(1, 0), q("a?"), "blue")  # answered again: one entry, the newest answer
    assert len(m) == 1 and m.nearest(unit(1, 0), q("x?"), 3, 0.0)[0].answer == "blue"
    m.add(unit(0, 1), q("b?"), "red")
    m.add(unit(1, 1), q("c?"), "red")  # the oldest (a?) goes out
    assert len(m) == 2 and {e.question.question for e in m.nearest(unit(1, 0), q("x?"), 3, -1.0)} == {"b?", "c?"}
    with pytest.raises(ValueError):
        m.add(unit(1, 0, 0), q("d?"), "red")  # another encoder's width


def test_the_examples_come_before_the_questions_own_context() -> None:
    m = Memory(4)
    m.add(unit(1, 0), q("Which is the sky's colour?"), "blue")
    shown = with_examples(
        Question("choice", "And the sea's?", ("red", "blue"), "A passage."), m.nearest(unit(1, 0), q("x"), 3, 0.0)
    )
    assert shown.context is not None and shown.context.endswith("A passage.")
    assert "Question: Which is the sky's colour?\nA. red\nB. blue\nAnswer: blue" in shown.context
    assert with_examples(q("y"), []) == q("y")
