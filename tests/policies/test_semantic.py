"""The pure routing rules and the reasoning adapter, one engine family at a time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies import loader, reasoning
from policies.errors import InvalidRequest, PolicyInvalid
from policies.schema import HeadRule, ModelSpec, SemanticModel
from policies.semantic import Prediction, choose_route, choose_route_turns, label_problems

VM = SemanticModel(
    type="semantic",
    default="small",
    categories={"math": "big"},
    min_confidence=0.5,
    unfamiliar="safe",
    reasoning={"mode": "auto", "threshold": 0.4},
)


def heads(category: str, confidence: float, pays: float) -> dict[str, Prediction]:
    return {
        "category": Prediction(category, confidence, {category: confidence}),
        "reasoning": Prediction("pays" if pays >= 0.5 else "no", max(pays, 1 - pays), {"pays": pays, "no": 1 - pays}),
    }


def test_rules_in_order() -> None:
    assert choose_route(VM, heads("math", 0.9, 0.6), familiar=True).model == "big"
    assert choose_route(VM, heads("math", 0.9, 0.6), familiar=False).reason == "unfamiliar"
    assert choose_route(VM, heads("law", 0.9, 0.1), familiar=True).reason == "default"
    # a mapped category under min_confidence without escalate_to: the default, not the category
    doubtful = choose_route(VM, heads("math", 0.3, 0.1), familiar=True)
    assert (doubtful.model, doubtful.reason) == ("small", "default")
    escalating = VM.model_copy(update={"escalate_to": "big"})
    assert choose_route(escalating, heads("law", 0.3, 0.1), familiar=True).reason == "escalated"


def flagged(base: dict[str, Prediction], p_router: float) -> dict[str, Prediction]:
    label = "router" if p_router >= 0.5 else "prompt"
    return {
        **base,
        "injection": Prediction(label, max(p_router, 1 - p_router), {"router": p_router, "prompt": 1 - p_router}),
    }


def test_a_prompt_addressed_to_the_router_takes_the_fixed_route_without_reasoning() -> None:
    escalating = VM.model_copy(update={"escalate_to": "big", "injection": "guarded"})
    route = choose_route(escalating, flagged(heads("math", 0.9, 0.9), 0.97), familiar=True)
    assert (route.model, route.reason, route.reasoning) == ("guarded", "injection", False)
    # without an `injection` route: the default, never escalate_to (what such a prompt asks for)
    route = choose_route(
        VM.model_copy(update={"escalate_to": "big"}), flagged(heads("math", 0.2, 0.9), 0.97), familiar=True
    )
    assert (route.model, route.reason) == ("small", "injection")
    # far from the training prompts but in English: still the injection route (router-aimed prompts
    # are far from the other heads' prompts; the injection head learnt them)
    assert choose_route(escalating, flagged(heads("math", 0.9, 0.9), 0.97), familiar=False).reason == "injection"
    # text the heads cannot read (another language, foreign words) takes the unfamiliar route; flagged
    # as aimed at the router too, it never falls back to escalate_to
    unread = {"familiar": False, "readable": False}
    assert choose_route(escalating, flagged(heads("math", 0.9, 0.9), 0.97), **unread).model == "safe"
    no_unfamiliar = escalating.model_copy(update={"unfamiliar": None})
    route = choose_route(no_unfamiliar, flagged(heads("math", 0.2, 0.9), 0.97), **unread)
    assert (route.model, route.reason, route.reasoning) == ("small", "unfamiliar", False)
    assert choose_route(no_unfamiliar, heads("math", 0.2, 0.9), familiar=False).model == "big"
    on = VM.model_copy(update={"reasoning": VM.reasoning.model_copy(update={"mode": "on"})})
    assert choose_route(on, flagged(heads("math", 0.9, 0.1), 0.97), familiar=True).reasoning is True
    assert choose_route(VM, flagged(heads("math", 0.9, 0.6), 0.2), familiar=True).reason == "category"  # not flagged
    # a short follow-up addressed to the router does not keep the conversation's route
    turn = choose_route_turns(
        VM, (flagged(heads("law", 0.6, 0.1), 0.9), True, True), (heads("math", 0.9, 0.1), True, True)
    )
    assert (turn.model, turn.reason, turn.follow_up) == ("small", "injection", False)


def test_reasoning_threshold_and_modes() -> None:
    assert choose_route(VM, heads("math", 0.9, 0.45), familiar=True).reasoning is True
    assert choose_route(VM, heads("math", 0.9, 0.35), familiar=True).reasoning is False
    off = VM.model_copy(update={"reasoning": VM.reasoning.model_copy(update={"mode": "off"})})
    assert choose_route(off, heads("math", 0.9, 0.99), familiar=True).reasoning is False


def test_follow_up_keeps_the_route_unless_confidently_different() -> None:
    kept = choose_route_turns(VM, (heads("law", 0.6, 0.1), True, True), (heads("math", 0.9, 0.1), True, True))
    assert (kept.model, kept.follow_up) == ("big", True)
    switched = choose_route_turns(VM, (heads("law", 0.95, 0.1), True, True), (heads("math", 0.9, 0.1), True, True))
    assert (switched.model, switched.follow_up) == ("small", False)


def typed(
    base: dict[str, Prediction], qtype: str, confidence: float, intent: str = "oos", intent_confidence: float = 0.9
) -> dict[str, Prediction]:
    return {
        **base,
        "question_type": Prediction(qtype, confidence, {qtype: confidence}),
        "intents": Prediction(intent, intent_confidence, {intent: intent_confidence}),
    }


RULED = VM.model_copy(
    update={
        "escalate_to": "big",
        "rules": [
            HeadRule(head="intents", labels=["transfer", "balance"], min_confidence=0.8, model="bank", reasoning="off"),
            HeadRule(head="question_type", labels=["choice", "yes_no"], min_confidence=0.7, model="small-scorer"),
        ],
    }
)


def test_head_rules_come_after_the_guard_and_before_the_category_map() -> None:
    base = heads("math", 0.9, 0.6)
    route = choose_route(RULED, typed(base, "open", 0.9, "transfer", 0.95), familiar=True)
    assert (route.model, route.reason, route.reasoning) == ("bank", "rule", False)  # the rule's own reasoning
    assert route.rule is not None and (route.rule.index, route.rule.label) == (0, "transfer")
    # the first rule is under its confidence: the second holds; reasoning by the virtual model's rule
    route = choose_route(RULED, typed(base, "choice", 0.75, "transfer", 0.6), familiar=True)
    assert (route.model, route.reason, route.reasoning, route.rule.index) == ("small-scorer", "rule", True, 1)
    # neither holds: the category map, as without rules
    assert choose_route(RULED, typed(base, "choice", 0.6, "oos"), familiar=True).reason == "category"
    # a rule holds for a doubtful category too: no escalation
    assert choose_route(RULED, typed(heads("law", 0.2, 0.1), "yes_no", 0.9), familiar=True).model == "small-scorer"
    assert choose_route(RULED, typed(heads("law", 0.2, 0.1), "open", 0.9), familiar=True).reason == "escalated"
    # the guard first: unfamiliar and router-aimed prompts never take a rule
    assert choose_route(RULED, typed(base, "choice", 0.99, "transfer", 0.99), familiar=False).reason == "unfamiliar"
    aimed = flagged(typed(base, "choice", 0.99, "transfer", 0.99), 0.97)
    assert choose_route(RULED, aimed, familiar=True).reason == "injection"
    # a head the request's classification lacks never holds
    assert choose_route(RULED, base, familiar=True).reason == "category"
    assert set(RULED.routes()) == {"small", "bank", "small-scorer", "big", "safe"}


def test_a_follow_up_switches_to_another_rule_only_when_sure() -> None:
    earlier = (typed(heads("math", 0.9, 0.1), "open", 0.9, "balance", 0.95), True, True)
    kept = choose_route_turns(RULED, (typed(heads("law", 0.5, 0.1), "open", 0.9, "oos"), True, True), earlier)
    assert (kept.model, kept.reason, kept.follow_up) == ("bank", "rule", True)
    # the same rule holds for the follow-up: still the conversation's
    same = choose_route_turns(
        RULED, (typed(heads("law", 0.5, 0.1), "open", 0.9, "transfer", 0.99), True, True), earlier
    )
    assert same.follow_up
    # another rule, sure enough: the follow-up's own route
    other = choose_route_turns(RULED, (typed(heads("law", 0.5, 0.1), "choice", 0.95, "oos"), True, True), earlier)
    assert (other.model, other.follow_up) == ("small-scorer", False)
    unsure = choose_route_turns(RULED, (typed(heads("law", 0.5, 0.1), "choice", 0.8, "oos"), True, True), earlier)
    assert unsure.follow_up
    # a rule held only weakly does not stop a confident change of category
    moved = choose_route_turns(RULED, (typed(heads("law", 0.95, 0.1), "choice", 0.8, "oos"), True, True), earlier)
    assert (moved.model, moved.reason, moved.follow_up) == ("small-scorer", "rule", False)


def test_the_rule_header_survives_any_label() -> None:
    from gateway.http.api import route_headers

    route = choose_route(RULED, typed(heads("math", 0.9, 0.6), "open", 0.9, "transfer", 0.95), familiar=True)
    assert route_headers(route, "none")["x-triage-rule"] == "0 intents=transfer 0.9500"
    odd = replace(route, rule=replace(route.rule, label="cañón de día"))
    header = route_headers(odd, "none")["x-triage-rule"]
    assert header == "0 intents=ca%C3%B1%C3%B3n%20de%20d%C3%ADa 0.9500" and header.isascii()


POLICY = """version: 1
classifier: {heads: [question_type, category, reasoning, injection], tasks: {intents: {data: intent/x.jsonl}}}
backends: {b: {type: scripted, echo: true}}
models: {small: {backend: b}, bank: {backend: b}}
virtual_models:
  auto:
    type: semantic
    default: small
    categories: {math: bank, maths: bank}
    rules:
      - {head: intents, labels: [transfer, tranfser], model: bank}
      - {head: question_type, labels: [choice], model: small}
"""


def test_rule_heads_and_labels_are_checked() -> None:
    pol = loader.parse(POLICY)
    classes = {"category": ("math", "law"), "intents": ("transfer", "oos"), "question_type": ("choice", "open")}
    assert label_problems(pol, classes) == [
        "virtual_models.auto.categories.maths: head 'category' has no class 'maths' (has: math, law)",
        "virtual_models.auto.rules[0].labels: head 'intents' has no class 'tranfser' (has: transfer, oos)",
    ]
    for head, why in (
        ("options", "is not one the classifier computes"),
        ("injection", "is not one"),
        ("topics", "is not one"),
        ("bank", "is not one"),
    ):
        with pytest.raises(PolicyInvalid, match=rf"rules\[0\]\.head: head '{head}' {why}"):
            loader.parse(POLICY.replace("head: intents", f"head: {head}"))
    with pytest.raises(PolicyInvalid, match=r"rules\[1\]\.model: model 'nowhere' is not defined"):
        loader.parse(POLICY.replace("model: small}", "model: nowhere}"))
    with pytest.raises(PolicyInvalid, match="the classifier has no `category` head"):
        loader.parse(POLICY.replace("heads: [question_type, category,", "heads: [question_type,"))
    for taken in ("question_type", "reference"):  # a task would overwrite a built-in head's artifacts
        with pytest.raises(PolicyInvalid, match=f"task name.s. {taken} are taken by built-in heads"):
            loader.parse(POLICY.replace("tasks: {intents:", f"tasks: {{{taken}:"))


@pytest.mark.parametrize(
    ("family", "on", "expected"),
    [
        ("qwen3", True, {"chat_template_kwargs": {"enable_thinking": True}}),
        ("qwen3", False, {"chat_template_kwargs": {"enable_thinking": False}}),
        ("gpt-5", False, {"reasoning_effort": "minimal"}),
        ("o-series", False, {"reasoning_effort": "low"}),
        ("o-series", True, {"reasoning_effort": "medium"}),
        ("openai", True, {}),  # gpt-4o and the like take no reasoning field
        ("generic", True, {}),
        ("granite-3.3", True, {"chat_template_kwargs": {"thinking": True}}),  # Granite's template key
        ("granite-3.3", False, {"chat_template_kwargs": {"thinking": False}}),
        ("deepseek-r1-distill", False, {"chat_template_kwargs": {"enable_thinking": False}}),
        ("deepseek-r1", False, {}),  # cannot stop thinking: nothing to send
        ("gemini-2.5-pro", False, {}),
        ("anthropic", True, {"thinking": {"type": "enabled", "budget_tokens": 2048}}),
        ("anthropic", False, {"thinking": {"type": "disabled"}}),
        ("gemini-2.5", True, {"thinking": {"type": "enabled", "budget_tokens": 2048}}),
        ("gemini-2.5", False, {"reasoning_effort": "disable"}),  # litellm: thinkingBudget 0
    ],
)
def test_switch_per_family(family: str, on: bool, expected: dict) -> None:
    body, _ = reasoning.apply({"model": "m"}, ModelSpec(backend="b", family=family), on)
    assert {k: v for k, v in body.items() if k != "model"} == expected


def test_client_switch_wins_and_bad_kwargs_are_400() -> None:
    spec = ModelSpec(backend="b", family="qwen3")
    body, switch = reasoning.apply({"chat_template_kwargs": {"enable_thinking": False}}, spec, True)
    assert switch == "client" and body["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(InvalidRequest):
        reasoning.apply({"chat_template_kwargs": "yes"}, spec, True)
    explicit = ModelSpec(backend="b", family="generic", reasoning_switch="reasoning_effort")
    assert reasoning.apply({}, explicit, False)[0] == {"reasoning_effort": "low"}
    claude = ModelSpec(backend="b", family="anthropic", thinking_budget=4096)
    assert reasoning.apply({}, claude, True) == ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, "thinking")
    assert reasoning.apply({"thinking": {"type": "disabled"}}, claude, True)[1] == "client"
    assert reasoning.apply({}, ModelSpec(backend="b", family="deepseek-r1"), False) == ({}, "always")
