"""Which chat requests are typed decisions, and what question they ask (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.service.typed import typed_ask
from policies.errors import InvalidRequest
from policies.tiers import Cascade

SPEC = Cascade(tiers=[{"name": "s", "type": "scorer", "backend": "b"}])


def body(prop: Any, messages: list[dict[str, Any]] | None = None, props: dict[str, Any] | None = None) -> dict:
    schema = {"type": "object", "properties": props if props is not None else {"answer": prop}}
    return {
        "model": "auto",
        "messages": messages or [{"role": "user", "content": "Q?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def test_enum_boolean_and_bounded_numbers() -> None:
    choice = typed_ask(body({"enum": ["a", 2, "c"]}), SPEC)
    assert choice is not None and choice.question.type == "choice" and choice.question.options == ("a", "2", "c")
    assert choice.values == ("a", 2, "c") and choice.prop == "answer"  # the JSON values, not their text
    yes_no = typed_ask(body({"type": "boolean"}), SPEC)
    assert yes_no is not None and yes_no.question.options == ("yes", "no") and yes_no.values == (True, False)
    scale = typed_ask(body({"type": "number", "minimum": 0.5, "maximum": 3.7}), SPEC)
    assert scale is not None and scale.question.scale == (1, 3) and scale.values == (1, 2, 3)


@pytest.mark.parametrize(
    "request_body",
    [
        body({"type": "string"}),
        body({"type": "integer"}),  # unbounded
        body(None, props={"a": {"type": "boolean"}, "b": {"type": "boolean"}}),
        {"model": "auto", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
        {"model": "auto", "messages": [{"role": "user", "content": "x"}]},
    ],
)
def test_other_requests_are_not_typed(request_body: dict) -> None:
    assert typed_ask(request_body, SPEC) is None


def test_the_last_user_turn_is_the_question_and_earlier_turns_its_context() -> None:
    ask = typed_ask(
        body(
            {"type": "boolean"},
            [
                {"role": "system", "content": "You judge."},
                {"role": "user", "content": "The sky is green."},
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": [{"type": "text", "text": "True?"}]},
                {"role": "assistant", "content": "Thinking"},
            ],
        ),
        SPEC,
    )
    assert ask is not None and ask.question.question == "True?"
    assert ask.question.context == "The sky is green.\n\nNoted."


def test_bad_typed_requests() -> None:
    with pytest.raises(InvalidRequest):
        typed_ask(body({"type": "boolean"}, [{"role": "system", "content": "no user"}]), SPEC)
    with pytest.raises(InvalidRequest):
        typed_ask(body({"enum": ["only"]}), SPEC)
    with pytest.raises(InvalidRequest):
        typed_ask(body({"type": "integer", "minimum": 0, "maximum": 1000}), SPEC)
