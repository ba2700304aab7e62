"""The policy file's ``models`` and ``virtual_models`` sections: a model's spec and prices, and the
virtual models (aliases, semantic routes, cascade models, the learned router's routed models).
Part of :mod:`policies.schema`, which re-exports every name."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from policies.errors import ErrorClass
from policies.quality import ShadowSpec
from policies.rollouts import GuardSpec
from policies.strict import Strict


class Prices(Strict):
    input_per_mtok: float = Field(0.0, ge=0)
    output_per_mtok: float = Field(0.0, ge=0)
    per_call: float = Field(0.0, ge=0)


ReasoningSwitch = Literal[
    "auto", "chat_template_kwargs", "reasoning_effort", "thinking", "gemini_thinking", "always", "none"
]


class ModelSpec(Strict):
    backend: str
    upstream: str | None = Field(None, description="the engine's model name; defaults to the key")
    family: str = "generic"
    reasoning_switch: ReasoningSwitch = Field("auto", description="how reasoning is turned on/off; auto: by family")
    thinking_budget: int = Field(
        2048, ge=1, description="tokens a `thinking` switch asks for (Anthropic takes 1024 or more)"
    )
    prices: Prices = Prices()
    fallbacks: list[str] = Field(default_factory=list)
    fallbacks_on: dict[ErrorClass, list[str]] = Field(
        default_factory=dict,
        description="models tried next when this one fails for that reason, before `fallbacks`: context_window "
        "(the prompt does not fit), rate_limit (429 or quota), content_policy (the provider refused the content), "
        "timeout, server_error (5xx, a refused or broken connection)",
    )
    tokenizer: str | None = Field(
        None,
        description="a HuggingFace tokenizer.json of the model, relative to the policy file: batches group "
        "its prompts by its tokens, and a long prompt is counted by them (a model on a GGUF backend uses "
        "the file's own)",
    )
    context_length: int | None = Field(
        None,
        ge=1,
        description="tokens the model takes, prompt and completion together; default: what its engine says "
        "(a llamacpp backend's n_ctx, vLLM's max_model_len); checked against the engine at start-up",
    )
    tools: bool | None = Field(None, description="whether it takes tools; default: what its backend says")
    images: bool | None = Field(
        None, description="whether it takes images; default: what its backend says (a llamacpp backend: no)"
    )
    json_schema: bool | None = Field(
        None, description="whether it answers to a JSON schema (response_format); default: what its backend says"
    )

    def tokenizer_file(self, policy_dir: Path) -> Path | None:
        """Where ``tokenizer`` points, from the policy file's folder."""
        return None if self.tokenizer is None else policy_dir / Path(self.tokenizer).expanduser()


class AliasModel(Strict):
    """A virtual model that serves the first of its targets that answers."""

    type: Literal["alias"]
    targets: list[str] = Field(min_length=1)
    description: str = ""


class SplitModel(Strict):
    """A virtual model whose traffic is split between targets by weight: a rollout (90% to the
    current model, 10% to a candidate), sticky per ``sticky`` so one user sees one model."""

    type: Literal["split"]
    targets: dict[str, float] = Field(
        min_length=1, description="model (or alias, semantic or routed virtual model) -> its weight, > 0"
    )
    sticky: Literal["user", "key", "session", "none"] = Field(
        "user",
        description="what keeps a caller on one target: user (the request's `user` field, else the key), key, "
        "session (the `x-session-id` header, else the user), none (each request drawn anew)",
    )
    guard: GuardSpec | None = Field(
        None, description="roll a candidate back to the primary when its errors or its agreement cross a bound"
    )
    shadow: ShadowSpec | None = Field(
        None,
        description="a sampled share of the candidates' answers asked of the primary too (`reference`: the primary)",
    )
    description: str = ""

    @field_validator("targets")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [name for name, w in v.items() if not w > 0 or w != w or w == float("inf")]
        if bad:
            raise ValueError(f"weights must be positive and finite: {', '.join(bad)}")
        return v


class ReasoningRule(Strict):
    mode: Literal["auto", "on", "off", "router"] = Field(
        "auto",
        description="auto: the reasoning head's P(pays) against `threshold`; router: the choice of the "
        "routed model `router` between its reasoning-off and reasoning-on candidates",
    )
    threshold: float = Field(0.5, ge=0, le=1, description="P(reasoning pays) from which it is switched on")
    router: str | None = Field(
        None, description="mode router: a routed virtual model whose candidates are one model with reasoning off and on"
    )

    @model_validator(mode="after")
    def _router_named(self) -> ReasoningRule:
        if (self.mode == "router") != (self.router is not None):
            raise ValueError("`router` names the routed model of `mode: router`, and only of it")
        return self


class HeadRule(Strict):
    """Route by any head's answer: when ``head`` answers one of ``labels`` at least ``min_confidence``
    sure, the request goes to ``model``. Rules are tried in order, after the guard and before the
    category map; the first that holds decides."""

    head: str = Field(description="a head of the classifier: question_type, category, reasoning, or a task's name")
    labels: list[str] = Field(min_length=1, description="the head's answers this rule takes")
    min_confidence: float = Field(0.0, ge=0, le=1, description="the head's confidence from which the rule holds")
    model: str
    reasoning: Literal["auto", "on", "off"] | None = Field(
        None, description="reasoning for this route; default: the virtual model's `reasoning` rule"
    )


class SemanticModel(Strict):
    """A virtual model routed by the encoder: head rules, category -> model, reasoning on/off, escalation."""

    type: Literal["semantic"]
    default: str = Field(description="the model when no rule applies")
    rules: list[HeadRule] = Field(default_factory=list, description="routes by any head's answer, tried first")
    categories: dict[str, str] = Field(default_factory=dict, description="category -> model")
    min_confidence: float = Field(0.0, ge=0, le=1, description="category confidence below which to escalate")
    escalate_to: str | None = None
    unfamiliar: str | None = Field(None, description="fixed route for out-of-distribution prompts")
    injection: str | None = Field(
        None,
        description="fixed route for prompts addressed to the router (the `injection` head says so); "
        "default: `default`, never `escalate_to`",
    )
    reasoning: ReasoningRule = ReasoningRule()
    follow_up_max_words: int = Field(6, ge=0, description="a turn this short may keep the conversation's route")
    follow_up_switch_confidence: float = Field(0.9, ge=0, le=1, description="...unless its own category is this sure")
    description: str = ""

    def routes(self) -> list[str]:
        """Every model this virtual model may route to, the default first."""
        fixed = (self.escalate_to, self.unfamiliar, self.injection)
        out = [self.default, *(r.model for r in self.rules), *self.categories.values(), *(m for m in fixed if m)]
        return list(dict.fromkeys(out))


class CascadeModel(Strict):
    """A virtual model for typed chat requests: a ``response_format`` JSON schema with one enum,
    boolean or bounded integer property is decided by the cascade; other requests go to ``open``."""

    type: Literal["cascade"]
    open: str = Field(description="the model (or alias/semantic virtual model) for untyped requests")
    description: str = ""


class RoutedCandidate(Strict):
    """One choice of a routed model: a model, with reasoning switched on or off where the labels
    tell the two apart (``reasoning/`` files: columns ``direct`` and ``cot``)."""

    model: str
    labels_as: str | None = Field(None, description="the labels file's column for this candidate; default: model")
    reasoning: Literal["on", "off"] | None = Field(
        None, description="reasoning for this candidate; default: the engine's own"
    )
    reasoning_tokens: int = Field(0, ge=0, description="output tokens reasoning adds, for the expected cost")

    @property
    def column(self) -> str:
        return self.labels_as or self.model


Learner = Literal["linear", "mf", "knn", "centroid"]


def _all_learners() -> list[Learner]:
    return ["linear", "mf", "knn", "centroid"]


class RouterProbe(Strict):
    """A routed model's difficulty probe: where the quality heads' two best candidates are close,
    a ``gguf_probe`` backend reads the prompt and a second head, fitted on MiniLM's embedding and
    that reading together, predicts instead (docs/router.md)."""

    backend: str = Field(description="a gguf_probe backend")
    margin: float = Field(
        0.05,
        ge=0,
        le=1,
        description="probe where the two best candidates' predicted P(right) are within this (1: every request)",
    )
    cost_per_call: float = Field(
        0.0, ge=0, description="what one reading costs, in the prices' money: counted in the route's expected cost"
    )
    timeout_s: float = Field(2.0, gt=0, description="a reading that takes longer is dropped: MiniLM's choice stands")


class RoutedModel(Strict):
    """A virtual model routed by predicted quality and cost (the learned router): per request, the
    quality heads predict P(right) for every candidate, and ``rule`` picks one with ``knob``
    (``triage calibrate --target strong_share=X | cost=X | quality=X | of_strong=X`` fits it)."""

    type: Literal["routed"]
    labels: str = Field(
        description="the labels the quality heads learn from, under the classifier's data_dir, "
        "e.g. model_labels/routellm_mmlu"
    )
    candidates: list[RoutedCandidate] = Field(min_length=2)
    rule: Literal["utility", "margin"] = Field(
        "utility", description="utility: max quality - knob * cost; margin: the cheapest within knob of the best"
    )
    knob: float = Field(0.0, ge=0, description="utility: quality points per unit of money; margin: a probability")
    output_tokens: int = Field(256, ge=0, description="output tokens expected per call, for the expected cost")
    prune_dominated: bool = Field(
        True, description="never choose a candidate that another one beat on the dev rows at no more cost"
    )
    learners: list[Learner] = Field(
        default_factory=_all_learners,
        description="learners `triage train` tries on dev rows (centroid where the labels have categories)",
    )
    shadow: ShadowSpec | None = Field(
        None, description="a sampled share of requests routed below the reference asked of the reference too"
    )
    probe: RouterProbe | None = Field(None, description="a difficulty probe where the heads' choice is close")
    description: str = ""

    def routes(self) -> list[str]:
        return list(dict.fromkeys(c.model for c in self.candidates))


VirtualModel = Annotated[
    AliasModel | SemanticModel | CascadeModel | RoutedModel | SplitModel, Field(discriminator="type")
]
