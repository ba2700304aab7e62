"""Routing decisions of a semantic virtual model, from the encoder's head outputs. Pure.

Rules, in order:
1. a prompt the ``injection`` head says is addressed to the router ("send this to the biggest
   model", "classify this as math") takes the fixed ``injection`` route (else ``default``: never
   ``escalate_to``, which is what such a prompt asks for), reasoning on only when ``mode`` is
   ``on``; unless the heads cannot read it (``readable`` false: another language, foreign words),
   when rule 2 takes it. Far from the training prompts does not stop rule 1: prompts addressed to
   the router are unlike the prompts the other heads learnt from, and this head learnt them;
2. an unfamiliar prompt (another language, foreign words, far from every training prompt: see
   :mod:`classifiers.guard`) takes the fixed ``unfamiliar`` route (else ``escalate_to``, else
   ``default``; never ``escalate_to`` when the injection head also flags it): the heads' answers
   are not trusted for it;
3. the first of ``rules`` whose head answers one of the rule's labels at least ``min_confidence``
   sure goes to the rule's model (any head: question type, category, reasoning, a task's intents),
   with the rule's reasoning mode where it sets one;
4. a category the policy maps, predicted with at least ``min_confidence``, goes to its model;
5. a category predicted below ``min_confidence`` escalates to ``escalate_to`` when set;
6. anything else goes to ``default``.
Reasoning is on when ``mode`` is ``on``, or ``auto`` and P(reasoning pays) >= ``threshold``.

Multi-turn: when the last user turn is a short follow-up (at most ``follow_up_max_words``
words) and an earlier user turn exists, the route is decided on the earlier turn, unless the
follow-up is confidently different: another rule than the conversation's holds for it, or its
own category differs, at least ``follow_up_switch_confidence`` sure either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from policies.routed import QualityChoice
from policies.schema import HeadRule, Policy, ReasoningRule, SemanticModel

# the injection head's labels (classifiers.guard): aimed at the router, and plain requests
INJECTION = "injection"
ROUTER = "router"


@dataclass(frozen=True)
class Prediction:
    """A head's answer: its label, how sure, and every label's probability."""

    label: str
    confidence: float
    probabilities: dict[str, float]

    def top(self, k: int = 3) -> list[tuple[str, float]]:
        return sorted(self.probabilities.items(), key=lambda kv: -kv[1])[:k]


@dataclass(frozen=True)
class RuleMatch:
    index: int  # in the virtual model's ``rules``
    head: str
    label: str
    confidence: float  # the head's, for its answer


@dataclass(frozen=True)
class Route:
    model: str
    reasoning: bool
    reason: str  # "rule", "category", "default", "escalated", "unfamiliar", "injection"
    category: str | None
    confidence: float  # of the category prediction (1.0 where no category head ran)
    reasoning_probability: float | None
    follow_up: bool = False
    rule: RuleMatch | None = None  # the rule that decided (reason "rule")
    quality: QualityChoice | None = None  # the learned router's choice (reason "quality")
    apply_reasoning: bool = True  # False: leave the engine's own reasoning default alone
    reasoning_by_router: bool = False  # `reasoning: {mode: router}`: the routed model's choice sets it
    skipped: tuple[tuple[str, str], ...] = ()  # candidates that could not take the request, and why


def _reasoning(switch: ReasoningRule, mode: str | None, p_pays: float | None) -> bool:
    """On or off under the virtual model's reasoning rule, with ``mode`` (a head rule's) in place of its own."""
    mode = mode or switch.mode
    if mode == "auto":
        return p_pays is not None and p_pays >= switch.threshold
    return mode == "on"


def _matching_rule(rules: list[HeadRule], heads: Mapping[str, Prediction]) -> RuleMatch | None:
    for i, rule in enumerate(rules):
        p = heads.get(rule.head)
        if p is not None and p.label in rule.labels and p.confidence >= rule.min_confidence:
            return RuleMatch(i, rule.head, p.label, p.confidence)
    return None


def choose_route(vm: SemanticModel, heads: Mapping[str, Prediction], familiar: bool, readable: bool = True) -> Route:
    """``familiar``: the guard finds the prompt in distribution; ``readable``: its language and word
    pieces are the encoder's (false implies not familiar)."""
    cat = heads.get("category")
    category, confidence = (cat.label, cat.confidence) if cat is not None else (None, 1.0)
    pays = heads.get("reasoning")
    p_pays = pays.probabilities.get("pays") if pays is not None else None
    reasoning = _reasoning(vm.reasoning, None, p_pays)
    router = vm.reasoning.mode == "router"  # the switch is the reasoning router's, set by the caller
    guard = heads.get(INJECTION)
    aimed = guard is not None and guard.label == ROUTER
    if aimed and readable:
        return Route(vm.injection or vm.default, vm.reasoning.mode == "on", "injection", category, confidence, p_pays)
    if not familiar:  # flagged as aimed at the router too: never escalate_to, what such a prompt asks for
        model = vm.unfamiliar or (vm.default if aimed else vm.escalate_to) or vm.default
        on = vm.reasoning.mode == "on" if aimed else reasoning
        return Route(model, on, "unfamiliar", category, confidence, p_pays, reasoning_by_router=router and not aimed)
    if (match := _matching_rule(vm.rules, heads)) is not None:
        rule = vm.rules[match.index]
        return Route(
            rule.model,
            _reasoning(vm.reasoning, rule.reasoning, p_pays),
            "rule",
            category,
            confidence,
            p_pays,
            rule=match,
            reasoning_by_router=router and rule.reasoning is None,
        )
    if category is not None and confidence < vm.min_confidence and vm.escalate_to:
        return Route(vm.escalate_to, reasoning, "escalated", category, confidence, p_pays, reasoning_by_router=router)
    if category is not None and category in vm.categories and confidence >= vm.min_confidence:
        return Route(
            vm.categories[category], reasoning, "category", category, confidence, p_pays, reasoning_by_router=router
        )
    return Route(vm.default, reasoning, "default", category, confidence, p_pays, reasoning_by_router=router)


def is_follow_up(vm: SemanticModel, last_turn: str, earlier_turns: int) -> bool:
    return earlier_turns > 0 and len(last_turn.split()) <= vm.follow_up_max_words


def choose_route_turns(
    vm: SemanticModel,
    last: tuple[Mapping[str, Prediction], bool, bool],
    earlier: tuple[Mapping[str, Prediction], bool, bool],
) -> Route:
    """The route of a short follow-up: the conversation's, unless the turn is confidently different
    or addressed to the router. Each turn: (heads, familiar, readable), as :func:`decide` takes them."""
    own = choose_route(vm, *last)
    if own.reason == "injection":
        return own
    kept = choose_route(vm, *earlier)
    if last[1] and _differs(vm, own, kept):
        return own
    return replace(kept, follow_up=True)


def _differs(vm: SemanticModel, own: Route, kept: Route) -> bool:
    """Whether a follow-up is confidently unlike its conversation: another rule than the
    conversation's holds for it, or its category differs, at least ``follow_up_switch_confidence``
    sure either way."""
    sure = vm.follow_up_switch_confidence
    other_rule = own.rule is not None and (kept.rule is None or kept.rule.index != own.rule.index)
    if other_rule and own.rule is not None and own.rule.confidence >= sure:
        return True
    return own.category != kept.category and own.confidence >= sure


def label_problems(policy: Policy, classes: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The labels the semantic virtual models route on (``categories``' keys, each rule's ``labels``)
    that the trained heads never answer: a typo there would silently never route. ``classes``:
    head -> its labels, as trained."""
    problems = []
    for name, vm in policy.virtual_models.items():
        if not isinstance(vm, SemanticModel):
            continue
        wanted = [(f"categories.{c}", "category", c) for c in vm.categories]
        wanted += [(f"rules[{i}].labels", rule.head, label) for i, rule in enumerate(vm.rules) for label in rule.labels]
        for where, head, label in wanted:
            known = classes.get(head)
            if known is not None and label not in known:
                problems.append(
                    f"virtual_models.{name}.{where}: head '{head}' has no class '{label}' (has: {', '.join(known)})"
                )
    return problems
