"""The cascade generator, driven with scripted tier answers (pure: no I/O)."""

from __future__ import annotations

import math

import pytest

from policies.cascade import YES_NO, Ask, CascadeExhausted, Gate, Question, TierAnswer, confidence, drive, steps

CHOICE = Question("choice", "Which?", ("a", "b", "c"))
YN = Question("yes_no", "Is it?", YES_NO)


def logs(*p: float) -> tuple[float, ...]:
    return tuple(math.log(x) for x in p)


def scripted(answers: dict[str, TierAnswer]):
    asked: list[str] = []

    def answer_for(ask: Ask) -> TierAnswer:
        asked.append(ask.tier)
        return answers[ask.tier]

    return answer_for, asked


def gates(**thresholds: dict[str, float]) -> list[Gate]:
    return [Gate(name, name, t) for name, t in thresholds.items()]


def test_confident_first_tier_answers_alone() -> None:
    answer_for, asked = scripted({"enc": TierAnswer(logs(0.8, 0.1, 0.1)), "pool": TierAnswer(logs(0.1, 0.8, 0.1))})
    d = drive(steps(CHOICE, gates(enc={"choice": 0.7}, pool={})), answer_for)
    assert (d.answer, d.tier, asked) == ("a", "enc", ["enc"])
    assert d.confidence == pytest.approx(0.8)
    assert [s.outcome for s in d.trace] == ["accepted"]


def test_below_threshold_escalates_and_the_last_tier_is_accepted_whatever_its_confidence() -> None:
    answer_for, asked = scripted({"enc": TierAnswer(logs(0.5, 0.3, 0.2)), "pool": TierAnswer(logs(0.2, 0.45, 0.35))})
    d = drive(steps(CHOICE, gates(enc={"choice": 0.7}, pool={"choice": 0.99})), answer_for)
    assert (d.answer, d.tier, asked) == ("b", "pool", ["enc", "pool"])
    assert [(s.tier, s.outcome, s.answer) for s in d.trace] == [("enc", "escalated", "a"), ("pool", "accepted", "b")]
    assert d.trace[0].threshold == 0.7


def test_yes_no_confidence_is_the_margin() -> None:
    assert confidence("yes_no", [0.7, 0.3]) == pytest.approx(0.4)
    assert confidence("yes_no", [0.5, 0.5]) == 0.0
    assert confidence("choice", [0.7, 0.3]) == pytest.approx(0.7)
    # p(yes) = 0.7 passes a 0.6 choice threshold but not a 0.6 yes/no threshold
    answer_for, _ = scripted({"enc": TierAnswer(logs(0.7, 0.3)), "pool": TierAnswer(logs(0.2, 0.8))})
    d = drive(steps(YN, gates(enc={"choice": 0.6, "yes_no": 0.6}, pool={})), answer_for)
    assert (d.answer, d.tier) == ("no", "pool")


def test_a_type_without_threshold_is_never_accepted_by_that_tier() -> None:
    answer_for, asked = scripted({"enc": TierAnswer(logs(0.99, 0.005, 0.005)), "pool": TierAnswer(logs(0.4, 0.3, 0.3))})
    d = drive(steps(CHOICE, gates(enc={"yes_no": 0.1}, pool={})), answer_for)
    assert d.tier == "pool" and asked == ["enc", "pool"]


def test_task_threshold_wins_over_the_type() -> None:
    q = Question("choice", "book a flight", ("flight", "hotel"), task="intents")
    g = [Gate("enc", "encoder", {"choice": 0.99}, {"intents": 0.6}), Gate("pool", "model")]
    answer_for, _ = scripted({"enc": TierAnswer(logs(0.7, 0.3)), "pool": TierAnswer(logs(0.1, 0.9))})
    assert drive(steps(q, g), answer_for).tier == "enc"


def test_temperature_changes_confidence_not_the_answer() -> None:
    hot = [Gate("enc", "encoder", {"choice": 0.0}, temperatures={"choice": 3.0})]
    cold = [Gate("enc", "encoder", {"choice": 0.0})]
    answer_for, _ = scripted({"enc": TierAnswer(logs(0.6, 0.3, 0.1))})
    a, b = drive(steps(CHOICE, hot), answer_for), drive(steps(CHOICE, cold), answer_for)
    assert a.answer == b.answer == "a"
    assert a.confidence < b.confidence
    assert sum(a.probabilities.values()) == pytest.approx(1.0)


def test_failed_and_skipped_tiers_escalate_and_say_why() -> None:
    answer_for, asked = scripted(
        {
            "enc": TierAnswer(skipped=True, error="no option scorer for choice questions"),
            "scorer": TierAnswer(error="timed out after 1s", latency_ms=1000.0),
            "pool": TierAnswer(logs(0.1, 0.1, 0.8)),
        }
    )
    d = drive(steps(CHOICE, gates(enc={"choice": 0.1}, scorer={"choice": 0.1}, pool={})), answer_for)
    assert d.answer == "c" and asked == ["enc", "scorer", "pool"]
    assert [(s.outcome, s.error) for s in d.trace[:2]] == [
        ("skipped", "no option scorer for choice questions"),
        ("failed", "timed out after 1s"),
    ]


def test_every_tier_failing_is_an_error_with_the_trace_never_a_guess() -> None:
    answer_for, _ = scripted({"enc": TierAnswer(error="down"), "pool": TierAnswer(error="connection refused")})
    with pytest.raises(CascadeExhausted) as info:
        drive(steps(CHOICE, gates(enc={"choice": 0.1}, pool={})), answer_for)
    exc = info.value
    assert exc.status == 502 and "connection refused" in exc.message
    assert [s["outcome"] for s in exc.body()["error"]["trace"]] == ["failed", "failed"]


def test_a_failed_top_tier_after_a_doubtful_answer() -> None:
    tiers = {"enc": TierAnswer(logs(0.5, 0.3, 0.2)), "pool": TierAnswer(error="502 from upstream")}
    answer_for, _ = scripted(tiers)
    with pytest.raises(CascadeExhausted):
        drive(steps(CHOICE, gates(enc={"choice": 0.9}, pool={})), answer_for)
    d = drive(steps(CHOICE, gates(enc={"choice": 0.9}, pool={}), on_exhausted="best"), answer_for)
    assert (d.answer, d.tier) == ("a", "enc")
    assert [s.outcome for s in d.trace] == ["escalated", "failed", "exhausted"]


def test_repeated_option_texts_share_one_probability() -> None:
    q = Question("choice", "Which?", ("x", "y", "x"))
    answer_for, _ = scripted({"enc": TierAnswer(logs(0.3, 0.4, 0.3))})
    d = drive(steps(q, [Gate("enc", "encoder", {"choice": 0.0})]), answer_for)
    assert d.probabilities == pytest.approx({"x": 0.6, "y": 0.4})
    assert d.answer == "y"  # the top option, as the tier ranked them


def test_numeric_question_takes_the_generated_number() -> None:
    q = Question("score", "What is 6 * 7?", ())
    assert q.numeric
    answer_for, _ = scripted(
        {
            "enc": TierAnswer(skipped=True, error="a numeric answer needs generation"),
            "pool": TierAnswer(text="42", confidence=0.9),
        }
    )
    d = drive(steps(q, gates(enc={"score": 0.5}, pool={})), answer_for)
    assert (d.answer, d.confidence, d.probabilities) == ("42", 0.9, {"42": 0.9})


def test_no_tiers_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        next(steps(CHOICE, []))
