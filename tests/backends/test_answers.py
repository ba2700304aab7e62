"""Reading generated answers: final numbers, option labels, label log-probabilities."""

from __future__ import annotations

import math

import pytest

from policies.answers import (
    assumed_scores,
    canonical_number,
    extract_number,
    label_in_text,
    label_logprobs,
    labels_for,
    same_number,
)


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("She pays 3 * 4 = 12 dollars.\n#### 12", "12"),
        ("First 5, then 7. The answer is $1,250.", "1250"),
        ("Answer: 18.50", "18.5"),
        ("Step 1: 2 + 2 = 4\nStep 2: 4 * 10 = 40\nSo 40 apples.", "40"),
        ("It drops by -3 degrees", "-3"),
        ("Answer: 7.0", "7"),
        ("Answer: 12 (from 3 boxes of 4)", "12"),
        ("no digits here", None),
    ],
)
def test_final_number(text: str, number: str | None) -> None:
    assert extract_number(text) == number


def test_same_number_tolerates_formatting_only() -> None:
    assert same_number("12.30", "12.3") and same_number("1,000", "1000") and same_number("7.0", "7")
    assert not same_number("12", "13") and not same_number("x", "1")
    assert canonical_number("inf") is None


def test_labels() -> None:
    assert labels_for("choice", ["p", "q", "r"]) == ("A", "B", "C")
    assert labels_for("choice", [str(i) for i in range(30)])[-1] == "30"
    assert labels_for("yes_no", ["yes", "no"]) == ("yes", "no")


def test_label_in_text() -> None:
    assert label_in_text("The answer is B.", ("A", "B", "C")) == 1
    assert label_in_text("(C)", ("A", "B", "C")) == 2
    assert label_in_text("Yes, it is.", ("yes", "no")) == 0
    assert label_in_text("a lower-case a is not the letter A", ("B", "C")) is None


def test_label_logprobs_reads_the_first_real_token() -> None:
    content = [
        {"token": " ", "logprob": -0.01, "top_logprobs": []},
        {
            "token": "B",
            "logprob": math.log(0.7),
            "top_logprobs": [
                {"token": "B", "logprob": math.log(0.7)},
                {"token": " A", "logprob": math.log(0.2)},
                {"token": "The", "logprob": math.log(0.05)},
            ],
        },
    ]
    scores = label_logprobs(content, ("A", "B", "C"))
    assert scores is not None
    p = [math.exp(s) for s in scores]
    assert p[0] == pytest.approx(0.2) and p[1] == pytest.approx(0.7)
    assert p[2] == pytest.approx(0.1)  # what is left, shared by the labels not listed
    assert label_logprobs([{"token": "The", "logprob": -0.1, "top_logprobs": []}], ("A", "B")) is None


def test_assumed_scores() -> None:
    p = [math.exp(s) for s in assumed_scores(4, 2, 0.7)]
    assert p == pytest.approx([0.1, 0.1, 0.7, 0.1])
