"""The policy file, modeled by pydantic v2 only.

Every model forbids unknown fields; backends are a discriminated union on ``type``. Cross
references (models -> backends, virtual models -> models, fallbacks -> models) are checked by
:func:`reference_problems`, which the loader runs so that each problem gets a YAML position.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from policies.quality import QualitySpec
from policies.rollouts import MirrorSpec
from policies.schema_access import Access, ApiKey, KeyLimits, Role, TeamSpec, TokenClaims, TokenSpec
from policies.schema_backends import (
    ENV_REF,
    LOCAL_GGUF,
    AdmissionSpec,
    Backend,
    GGUFProbeBackendSpec,
    GGUFScorerBackendSpec,
    GGUFSource,
    HealthCheck,
    LiteLLMBackendSpec,
    LlamaCppBackendSpec,
    OpenAIBackendSpec,
    Replica,
    Retries,
    ScriptedBackendSpec,
    ScriptedReply,
    ScriptedToolCall,
    Timeouts,
)
from policies.schema_guardrails import GuardrailsSpec
from policies.schema_models import (
    AliasModel,
    CascadeModel,
    HeadRule,
    Learner,
    ModelSpec,
    Prices,
    ReasoningRule,
    ReasoningSwitch,
    RoutedCandidate,
    RoutedModel,
    RouterProbe,
    SemanticModel,
    SplitModel,
    VirtualModel,
)
from policies.strict import Strict
from policies.tiers import Cascade

Loc = tuple[str | int, ...]


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
        if v is not None and not (v.startswith(("postgresql://", "postgres://")) or ENV_REF.match(v)):
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
    shared: bool = Field(
        True,
        description="with state.store: redis, each request's summary also kept in a ring in Redis (console.recent "
        "of them) that every gateway's traffic and request pages read, kept across restarts",
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
    teams: dict[str, TeamSpec] = Field(default_factory=dict, description="teams: their models and shared limits")
    access: Access = Access()
    state: StateSpec = StateSpec()
    logging: Logging = Logging()
    tracing: TracingSpec = TracingSpec()
    response_cache: ResponseCacheSpec | None = Field(None, description="answers kept and served again (off: unset)")
    quality: QualitySpec | None = Field(
        None, description="records of cascade and routed answers, shadow checks and feedback (off: unset)"
    )
    mirrors: dict[str, MirrorSpec] = Field(
        default_factory=dict,
        description="model name a request names -> a candidate asked a share of its requests in the background",
    )
    console: ConsoleSpec = ConsoleSpec()
    guardrails: GuardrailsSpec | None = Field(
        None, description="checks on requests and answers: PII, jailbreaks, hooks (off: unset)"
    )

    def upstream_name(self, model: str) -> str:
        spec = self.models[model]
        return spec.upstream or model


__all__ = [
    "LOCAL_GGUF",
    "Access",
    "AdmissionSpec",
    "AliasModel",
    "ApiKey",
    "Backend",
    "BatchSettings",
    "BuiltinHead",
    "CascadeModel",
    "ClassifierSpec",
    "ConsoleSpec",
    "EncoderConfig",
    "GGUFProbeBackendSpec",
    "GGUFScorerBackendSpec",
    "GGUFSource",
    "HeadRule",
    "HealthCheck",
    "KeyLimits",
    "Learner",
    "Limits",
    "LiteLLMBackendSpec",
    "LlamaCppBackendSpec",
    "Loc",
    "Logging",
    "ModelSpec",
    "OpenAIBackendSpec",
    "Policy",
    "Prices",
    "ReasoningRule",
    "ReasoningSwitch",
    "Replica",
    "ResponseCacheSpec",
    "Retries",
    "Role",
    "RoutedCandidate",
    "RoutedModel",
    "RouterProbe",
    "ScriptedBackendSpec",
    "ScriptedReply",
    "ScriptedToolCall",
    "SemanticCacheSpec",
    "SemanticModel",
    "SplitModel",
    "StateSpec",
    "TaskHead",
    "TeamSpec",
    "Timeouts",
    "TokenClaims",
    "TokenSpec",
    "TracingSpec",
    "VirtualModel",
]
