"""The ``cascade`` section of a policy: the tiers of typed decisions and their numbers."""

from __future__ import annotations

import string
from typing import Annotated, Literal

from pydantic import Field, model_validator

from policies.pool import Agreement
from policies.quality import ShadowSpec
from policies.strict import Strict

QuestionType = Literal["choice", "yes_no", "score"]
_Unit = Annotated[float, Field(ge=0, le=1)]
_Positive = Annotated[float, Field(gt=0)]
_FIELDS = {"question", "context", "min", "max"}


class TierPrices(Strict):
    """What asking this tier costs, for `triage eval`'s cost figures (any currency, same for all tiers)."""

    per_call: float = Field(0.0, ge=0)
    per_1k_tokens: float = Field(0.0, ge=0, description="prompt and completion tokens the tier reported")


class AgreementSpec(Strict):
    """How far the answers so far are trusted as votes (``policies/agreement.py``), fitted on dev rows
    (``eval/pool_fit.py``): the tier's confidence is then the votes' calibrated P(right)."""

    temper: _Positive = Field(
        1.0, description="each vote's weight is multiplied by this (errors shared across tiers: < 1)"
    )
    spread: float = Field(
        0.0, ge=0, description="the options a wrong answer lands on, as if spread among them (0: all the others)"
    )
    a: float = Field(1.0, description="Platt slope: P(right) = sigmoid(a * logit(the posterior's top) + b)")
    b: float = Field(0.0, description="Platt intercept")
    own_temper: float = Field(
        0.0,
        ge=0,
        le=4,
        description="the weight of each tier's own measured log-probabilities beside its vote (0: none)",
    )

    def rule(self) -> Agreement:
        """The numbers as the cascade reads them (:class:`policies.pool.Agreement`)."""
        return Agreement(self.temper, self.own_temper, self.a, self.b, self.spread)


class _Tier(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    prices: TierPrices = TierPrices()
    thresholds: dict[QuestionType, _Unit] = Field(
        default_factory=dict, description="accept at this confidence or above; a type left out is never accepted here"
    )
    task_thresholds: dict[str, _Unit] = Field(default_factory=dict, description="per task, over the type's")
    temperature: dict[QuestionType, _Positive] = Field(default_factory=dict, description="fitted per type")
    task_temperature: dict[str, _Positive] = Field(
        default_factory=dict, description="per task, over the type's (a task's head has its own calibration)"
    )
    gate: Literal["confidence", "learned"] = Field(
        "confidence",
        description="what the thresholds are compared with: the tier's own confidence, or a learned model's "
        "P(this tier's answer is right) (`confidence-<tier>` in the cascade's artifacts, fitted by `triage train`)",
    )
    escalation_margin: float | None = Field(
        None,
        ge=0,
        le=1,
        description="with gate: learned, keep an answer only if its P(right) is within this margin of P(escalating "
        "gets it right) (the last tier's record on the nearest fitting questions), besides the threshold; unset: off",
    )
    timeout_s: float = Field(30.0, gt=0)
    accuracy: dict[QuestionType, Annotated[float, Field(gt=0, lt=1)]] = Field(
        default_factory=dict,
        description="this tier's accuracy per type on dev rows: its answer's weight as a vote where a tier reads "
        "agreement (a type left out: no vote)",
    )
    examples: bool = Field(
        False,
        description="with the cascade's `memory`: this tier is asked with the nearest questions the last tier "
        "answered before, as solved examples in its prompt",
    )
    agreement: dict[QuestionType, AgreementSpec] = Field(
        default_factory=dict,
        description="per type: this tier's answer and confidence are the votes of every tier that answered so far, "
        "itself included (a number's question is read on the tier's own confidence); `triage eval` fits it and "
        "every tier's accuracy on dev rows",
    )

    @model_validator(mode="after")
    def _margin_needs_a_judge(self) -> _Tier:
        if self.escalation_margin is not None and self.gate != "learned":
            raise ValueError("escalation_margin compares a learned P(right): it needs gate: learned")
        if self.agreement and self.gate == "learned":
            raise ValueError("agreement is this tier's confidence: it cannot also be gated by a learned model")
        return self


class EncoderTier(_Tier):
    """Tier 0: the policy's task heads, else the generic option scorer on the embedding."""

    type: Literal["encoder"]


class ScorerTemplates(Strict):
    """Prompts of the GGUF scorer, per question type. Placeholders: {context} (rendered with the
    ``context`` template, or empty), {question}, and for ``score`` {min} and {max}. Each option is
    scored as the continuation ``option`` (with {option}) of the prompt."""

    version: str = "1"
    choice: str = "{context}Question: {question}\nAnswer:"
    yes_no: str = "{context}Question: {question}\nAnswer (yes or no):"
    score: str = "{context}Question: {question}\nAnswer (a number from {min} to {max}):"
    context: str = "{context}\n\n"
    option: str = " {option}"

    @model_validator(mode="after")
    def _placeholders(self) -> ScorerTemplates:
        for name in ("choice", "yes_no", "score", "context", "option"):
            allowed = {"option"} if name == "option" else ({"context"} if name == "context" else _FIELDS)
            try:
                used = {f for _, f, _, _ in string.Formatter().parse(getattr(self, name)) if f is not None}
            except ValueError as exc:
                raise ValueError(f"template {name}: {exc}") from None
            if used - allowed:
                raise ValueError(f"template {name} uses unknown placeholders {sorted(used - allowed)}")
        return self


class ScorerTier(_Tier):
    """Tier 1: a ``gguf_scorer`` backend scores each option by log-probability."""

    type: Literal["scorer"]
    backend: str
    mode: Literal["cloze", "lettered", "reasoned"] = Field(
        "cloze",
        description="cloze: each option scored as a continuation of `templates` (base models); lettered: "
        "the options listed with letters (or yes/no, or a scale's values) in the model's chat "
        "template, read from the next token's distribution over the letters (instruct models); reasoned: "
        "lettered after the model has stated the facts in up to `reason_tokens` tokens (slower, surer)",
    )
    reason_tokens: int = Field(
        64, ge=1, le=1024, description="reasoned mode: the most tokens written before the answer"
    )

    orders: int = Field(
        1,
        ge=1,
        le=4,
        description="lettered and reasoned modes: read a choice question in this many orders of its options (as "
        "given, reversed, turned by half, that reversed) and answer on their mean probabilities (a prefill each; "
        "a small model's pick leans on the letters' positions, and where it moves with them it was guessing)",
    )

    @property
    def reasoning_budget(self) -> int:
        """The tokens the model may write before its answer: 0 unless the mode is reasoned."""
        return self.reason_tokens if self.mode == "reasoned" else 0

    @model_validator(mode="after")
    def _orders_are_lettered(self) -> ScorerTier:
        if self.orders > 1 and self.mode == "cloze":
            raise ValueError("orders turns the letters of a lettered or reasoned tier: cloze scores no letters")
        return self

    templates: ScorerTemplates = ScorerTemplates()
    length_norm: Literal["none", "tokens"] = Field(
        "tokens", description="multi-token options: sum of log-probabilities, or their mean per token"
    )


class ModelTier(_Tier):
    """Tier 2: a policy model, asked through the OpenAI API for the option's letter or word."""

    type: Literal["model"]
    model: str
    constrain: Literal["none", "guided_choice", "structured_outputs", "regex", "grammar"] = Field(
        "none",
        description="the engine's constrained decoding: vLLM structured_outputs (a choice of the labels, a "
        "scale as a regex of its values; guided_choice before v0.12: vLLM 0.32 ignores guided_choice, a "
        "top-level regex and grammar without an error), SGLang regex, llama.cpp grammar (a GBNF grammar of "
        "the labels: the in-process backend and llama.cpp's server); none for engines without it",
    )
    logprobs: bool = Field(True, description="ask for top_logprobs to read option probabilities")
    assumed_confidence: _Unit = Field(0.9, description="confidence of an answer that came without logprobs")
    max_tokens: int = Field(4, ge=1, description="tokens for a choice answer")
    numeric_max_tokens: int = Field(512, ge=1, description="tokens for a worked numeric answer")


Tier = Annotated[EncoderTier | ScorerTier | ModelTier, Field(discriminator="type")]


class MemorySpec(Strict):
    """The top tier's answers kept for the cheap tiers (``policies/memory.py``): escalations and shadow
    checks, keyed by the encoder's embedding of the question (the policy needs a classifier)."""

    size: int = Field(10000, ge=1, le=1_000_000, description="questions kept, the oldest out first (per gateway)")
    examples: int = Field(3, ge=1, le=16, description="the most solved examples a tier with `examples` is given")
    min_similarity: float = Field(0.6, ge=-1, le=1, description="cosine similarity an example needs at least")
    shared: bool = Field(
        True,
        description="where the state store is Redis (`state.store: redis`), every gateway's answers are "
        "shared through it (gateway/state/memory_redis.py); else each gateway keeps its own",
    )


class RoutingSpec(Strict):
    """Route and cascade as one decision (``policies/cascade_routing.py``): the next tier is the one
    whose answer is expected to add most to the votes' P(right) for its cost, until none is worth it."""

    knob: _Positive = Field(description="P(right) given up per unit of the tiers' prices (their `prices`)")
    agreement: dict[QuestionType, AgreementSpec] = Field(
        min_length=1, description="per type routed: how far the votes are trusted (fitted on dev rows)"
    )


class Cascade(Strict):
    """Typed decisions: tier after tier until one is confident enough (``/v1/decide``)."""

    tiers: list[Tier] = Field(min_length=1)
    on_exhausted: Literal["error", "best"] = Field(
        "error", description="no tier accepted: a 502 with the trace, or the most confident answer seen"
    )
    artifacts: str | None = Field(
        None,
        description="where the learned gates' models are, relative to the policy file; default: the classifier's "
        "artifacts folder",
    )
    max_batch: int = Field(256, ge=1, description="questions per /v1/decide/batch request")
    max_options: int = Field(64, ge=2, le=64)
    max_scale: int = Field(101, ge=2, description="values a score scale may have")
    escalation_budget: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="the share of questions the first tier may send on: the gateway shifts the thresholds of "
        "every tier but the last to hold it under shifting traffic (policies/budget.py); none: fixed thresholds",
    )
    budget_floor: float = Field(0.0, ge=0, le=1, description="no shifted threshold goes below this (quality floor)")
    budget_max_shift: float = Field(0.3, gt=0, le=1, description="the most the thresholds move either way")
    budget_step: float = Field(0.01, gt=0, le=0.5, description="how far one question moves them")
    budget_window: int = Field(500, ge=10, description="questions the reported escalated share is taken over")
    cache_ttl_s: float | None = Field(
        None,
        gt=0,
        description="keep each typed decision this long in the state store, keyed by the policy's version and the "
        "question (type, text, options, context, scale, task): the same question is answered from it; none: off",
    )
    shadow: ShadowSpec | None = Field(
        None, description="a sampled share of decisions kept below the last tier asked of the last tier too (quality)"
    )
    memory: MemorySpec | None = Field(
        None, description="keep the last tier's answers and give the nearest as examples to tiers with `examples`"
    )
    routing: RoutingSpec | None = Field(
        None,
        description="the types it names are routed: each next tier chosen by its expected gain for its cost, not "
        "in the listed order (tiers need `accuracy` and `prices`); none: tier after tier",
    )

    @model_validator(mode="after")
    def _routing_reads_no_thresholds(self) -> Cascade:
        if self.memory is None and any(t.examples for t in self.tiers):
            raise ValueError("a tier with examples needs the cascade's `memory` to draw them from")
        if any(t.examples and t.type == "encoder" for t in self.tiers):
            raise ValueError("the encoder tier reads no prompt: examples are for scorer and model tiers")
        if self.routing is not None and self.escalation_budget is not None:
            raise ValueError("routing chooses tiers by expected gain, not by thresholds: escalation_budget moves none")
        return self
