"""The offline cascade eval on a small fixture: fitted thresholds, replayed decisions, the cache."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eval.cascade_eval import TierSpec, evaluate
from eval.cascade_fit import fit_temperatures, fit_thresholds
from eval.tier_outputs import Row, TierCache, typed_rows
from policies.cascade import YES_NO, Question, TierAnswer


def row(i: int, answer: str = "yes", split: str = "dev") -> Row:
    return Row(f"s-{split}-{i}", "s", split, Question("yes_no", f"q{i}?", YES_NO), answer, None)


def yes(p: float) -> TierAnswer:
    return TierAnswer(scores=(math.log(p), math.log(1 - p)), latency_ms=1.0)


def test_threshold_keeps_only_what_the_cheap_tier_gets_as_right_as_the_top() -> None:
    # the cheap tier is right when sure (p = 0.95 on yes rows) and wrong when unsure (p = 0.6 on no rows)
    rows = [row(i, "yes") for i in range(20)] + [row(i, "no") for i in range(20, 40)]
    cheap = TierSpec("cheap", "encoder", {r.id: yes(0.95 if r.answer == "yes" else 0.58) for r in rows})
    top = TierSpec("top", "recorded", {r.id: yes(0.99 if r.answer == "yes" else 0.01) for r in rows})
    fit_thresholds([cheap, top], rows)
    t = cheap.thresholds["yes_no"]
    assert 2 * 0.58 - 1 < t <= 2 * 0.95 - 1  # the unsure margin is escalated, the sure one kept
    [report] = evaluate([cheap, top], [Row(r.id, r.source, "test", r.question, r.answer, None) for r in rows])
    assert report.n == 40 and report.cascade == 1.0
    assert report.alone == {"cheap": 0.5, "top": 1.0}
    assert report.share == {"cheap": 0.5, "top": 0.5} and report.past_first == 0.5
    assert report.latency_ms == {"cheap": 1.0, "top": 1.0}
    assert report.by_category == {"-": {"n": 40, "accuracy": 1.0, "past_first": 0.5}}


def test_cost_counts_every_tier_asked() -> None:
    rows = [row(i, "yes", "test") for i in range(10)] + [row(i, "no", "test") for i in range(10, 20)]
    cheap = TierSpec(
        "cheap",
        "encoder",
        {r.id: yes(0.95 if r.answer == "yes" else 0.58) for r in rows},
        thresholds={"yes_no": 0.5},
        per_call=1.0,
    )
    top = TierSpec(
        "top",
        "recorded",
        {r.id: TierAnswer(scores=yes(0.99).scores, usage={"prompt_tokens": 500}) for r in rows},
        per_call=10.0,
        per_1k_tokens=2.0,
    )
    [report] = evaluate([cheap, top], rows)
    assert report.cost_top_per_question == pytest.approx(11.0)  # 10 per call + 500 tokens at 2 per 1k
    assert report.cost_per_question == pytest.approx(1.0 + 0.5 * 11.0)  # everyone asks cheap, half go on


def test_temperature_is_fitted_per_type_on_dev_rows() -> None:
    rows = [row(i, "yes" if i % 10 else "no") for i in range(100)]  # 90% yes
    overconfident = TierSpec("t", "scorer", {r.id: yes(0.999) for r in rows})
    fit_temperatures(overconfident, rows)
    assert overconfident.temperatures["yes_no"] > 1.5  # softened toward the 90% it earns


def test_cache_resumes_without_recomputing(tmp_path: Path) -> None:
    rows = [row(i) for i in range(5)]
    calls: list[str] = []

    def compute(r: Row) -> TierAnswer:
        calls.append(r.id)
        return yes(0.7)

    path = tmp_path / "tier.jsonl"
    TierCache(path).fill(rows[:3], compute)
    with path.open("a") as f:
        f.write('{"id": "s-dev-3", "scores": [0.1')  # a line cut short by an interrupted run
    got = TierCache(path).fill(rows, compute)
    assert calls == ["s-dev-0", "s-dev-1", "s-dev-2", "s-dev-3", "s-dev-4"]  # each once; the cut row again
    assert set(got) == {r.id for r in rows}
    assert TierCache(path).rows["s-dev-4"].scores == pytest.approx(yes(0.7).scores)


def test_typed_rows_sample_is_seeded_and_split(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with path.open("w") as f:
        for i in range(50):
            f.write(
                json.dumps(
                    {
                        "id": f"t-{'dev' if i % 2 else 'test'}-{i}",
                        "source": "t",
                        "type": "choice",
                        "question": "?",
                        "context": None,
                        "options": ["a", "b"],
                        "answer": "a",
                        "category": None,
                        "split": "dev" if i % 2 else "test",
                    }
                )
                + "\n"
            )
        f.write(
            json.dumps(
                {
                    "id": "t-test-99",
                    "source": "t",
                    "type": "score",
                    "question": "?",
                    "context": None,
                    "options": None,
                    "answer": "3",
                    "category": None,
                    "split": "test",
                }
            )
            + "\n"
        )
    a, b = typed_rows(path, "test", 10), typed_rows(path, "test", 10)
    assert [r.id for r in a] == [r.id for r in b] and len(a) == 10
    assert all(r.split == "test" and r.question.type == "choice" for r in a)
    assert len(typed_rows(path, "dev")) == 25


def test_numeric_rows_are_compared_as_numbers() -> None:
    q = Question("score", "How many?", ())
    rows = [Row(f"n-test-{i}", "n", "test", q, "1250", None) for i in range(3)]
    skip = TierAnswer(skipped=True, error="a numeric answer needs generation")
    cheap = TierSpec("scorer", "scorer", {r.id: skip for r in rows})
    top = TierSpec(
        "top",
        "model",
        {
            rows[0].id: TierAnswer(text="1,250.0", confidence=0.9),
            rows[1].id: TierAnswer(text="1250", confidence=0.9),
            rows[2].id: TierAnswer(text="125", confidence=0.9),
        },
    )
    [report] = evaluate([cheap, top], rows)
    assert report.cascade == pytest.approx(2 / 3) and report.alone["top"] == pytest.approx(2 / 3)
    assert report.share == {"scorer": 0.0, "top": 1.0}


def test_sweep_curve_and_apgr() -> None:
    # the cheap tier is right on its sure half and wrong on its unsure half; the top tier always right
    rows = [row(i, "yes", "test") for i in range(10)] + [row(i, "no", "test") for i in range(10, 20)]
    cheap = TierSpec("cheap", "encoder", {r.id: yes(0.95 if r.answer == "yes" else 0.6) for r in rows})
    top = TierSpec("top", "recorded", {r.id: yes(0.99 if r.answer == "yes" else 0.01) for r in rows})
    [report] = evaluate([cheap, top], rows)
    c = report.curve
    assert (c.first, c.last) == (0.5, 1.0)
    assert (0.0, 0.5) in c.points and (1.0, 1.0) in c.points and (0.5, 1.0) in c.points
    # escalating the unsure half recovers it all; RouteLLM's CPT reads the curve linear between its points
    assert c.share_for_50 == pytest.approx(0.25) and c.share_for_80 == pytest.approx(0.4)
    assert c.apgr == pytest.approx(0.75)  # PGR 0 -> 1 over [0, 0.5], then 1: better than random's 0.5
    assert c.anchored is not None and c.anchored.cost_for_100 == pytest.approx(0.5)


def test_bad_lines_are_reported_with_their_number_and_skipped(tmp_path: Path) -> None:
    good = {
        "id": "t-test-0",
        "source": "t",
        "type": "choice",
        "question": "?",
        "context": None,
        "options": ["a", "b"],
        "answer": "a",
        "category": None,
        "split": "test",
        "extra": "ignored",
    }
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({**good, "id": "t-test-1", "answer": "c"}),
        json.dumps({**good, "id": "t-test-2", "type": "essay"}),
        json.dumps({**good, "id": "t-test-3", "question": None}),
        json.dumps([1, 2]),
        json.dumps(good),
        json.dumps({**good, "id": "t-test-4", "type": "yes_no", "options": None, "answer": "maybe"}),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems: list[str] = []
    rows = typed_rows(path, "test", problems=problems)
    assert [r.id for r in rows] == ["t-test-0"]
    assert problems == [
        "t.jsonl:2: not JSON (Expecting property name enclosed in double quotes)",
        "t.jsonl:3: answer 'c' is not among the options",
        "t.jsonl:4: unknown type 'essay'",
        "t.jsonl:5: missing or not a string: question",
        "t.jsonl:6: not a JSON object",
        "t.jsonl:7: duplicate id 't-test-0'",
        "t.jsonl:8: a yes_no answer is 'yes' or 'no', not 'maybe'",
    ]
    (tmp_path / "empty.jsonl").write_text("")
    assert typed_rows(tmp_path / "empty.jsonl", "test", problems=problems) == []


def test_threshold_targets() -> None:
    rows = [row(i, "yes") for i in range(20)] + [row(i, "no") for i in range(20, 40)]

    def spec() -> TierSpec:
        return TierSpec("cheap", "encoder", {r.id: yes(0.95 if r.answer == "yes" else 0.58) for r in rows})

    top = TierSpec("top", "recorded", {r.id: yes(0.99 if r.answer == "yes" else 0.01) for r in rows})
    easy, strict = spec(), spec()
    fit_thresholds([easy, top], rows, target=("accuracy", 0.5))
    fit_thresholds([strict, top], rows, target=("accuracy", 0.9))
    assert easy.thresholds["yes_no"] == 0.0  # right half the time on everything: a 0.5 target keeps it all
    assert 2 * 0.58 - 1 < strict.thresholds["yes_no"] <= 2 * 0.95 - 1
    spread = TierSpec("cheap", "encoder", {r.id: yes(0.51 + i / 100) for i, r in enumerate(rows)})
    fit_thresholds([spread, top], rows, target=("escalation", 0.25))
    [report] = evaluate([spread, top], rows)
    assert report.past_first == pytest.approx(0.25, abs=1 / 40)


def test_cost_target_picks_the_best_accuracy_within_budget() -> None:
    from eval.cascade_fit import fit_for_cost

    rows = [row(i, "yes") for i in range(10)] + [row(i, "no") for i in range(10, 20)]
    cheap = TierSpec("cheap", "encoder", {r.id: yes(0.95 if r.answer == "yes" else 0.58) for r in rows}, per_call=1)
    top = TierSpec("top", "recorded", {r.id: yes(0.99 if r.answer == "yes" else 0.01) for r in rows}, per_call=10)
    fit_for_cost([cheap, top], rows, budget=6.0)  # 1 + half of 10: escalate exactly the unsure half
    [report] = evaluate([cheap, top], rows)
    assert report.cost_per_question == pytest.approx(6.0) and report.cascade == 1.0
    fit_for_cost([cheap, top], rows, budget=0.5)  # nothing fits: the cheapest plan
    [report] = evaluate([cheap, top], rows)
    assert report.cost_per_question == pytest.approx(1.0) and report.past_first == 0.0
