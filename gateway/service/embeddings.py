"""``POST /v1/embeddings``: the encoder's model, served by name, on the encoder already loaded.

With a ``classifier`` section the policy serves its encoder as an embedding model:
``all-minilm-l6-v2`` (``-<n>layers`` when ``classifier.encoder.layers`` keeps fewer than MiniLM's
six: another model, so another name), int8 or fp32 as the policy says, the same ONNX session as the
heads, through its own micro-batcher (concurrent requests share forwards; the vector only, no
sentence or language reading). The answer is OpenAI's: unit vectors, as floats or, with
``encoding_format: base64``, little-endian float32 bytes (what the official clients ask for by
default). A text over the encoder's window is read head and tail (its first and last tokens), as
the heads read it; ``usage.prompt_tokens`` counts every token sent.

A policy model (or alias) whose backend has an embeddings API (``openai`` and ``litellm``
backends) is served by its engine instead: the body passed through down the model's chain, as for
chat (a backend without one is skipped; a chain with none is a 404).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.base import Completion
from classifiers.artifacts import MODEL_NAME
from gateway.service import job as jobs
from gateway.service.bodies import check
from gateway.service.context import Context
from gateway.service.dispatch import Served, dispatch
from gateway.service.runtime import Runtime
from policies.errors import InvalidRequest, ModelNotFound
from policies.plans import public_models, resolve
from policies.schema import ClassifierSpec

MAX_INPUTS = 2048  # OpenAI's limit per request
ENCODER = "encoder"  # the backend and replica an answer of the in-process encoder is served by
FULL_LAYERS = 6


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _bounded(cls, v: Any) -> Any:
        """OpenAI's cap on inputs per request, for the encoder and a proxied engine alike (a list
        of token ids is one input)."""
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs per request, not {len(v)}")
        return v


def model_name(config: ClassifierSpec) -> str:
    """The name the policy's encoder is served under."""
    layers = config.encoder.layers
    return MODEL_NAME if layers >= FULL_LAYERS else f"{MODEL_NAME}-{layers}layers"


def served_models(rt: Runtime) -> list[str]:
    return [model_name(rt.policy.classifier)] if rt.encoding is not None and rt.policy.classifier else []


def _texts(req: EmbeddingsRequest) -> list[str]:
    given = req.input
    if isinstance(given, str):
        given = [given]
    if not given:
        raise InvalidRequest("'input' is empty: send a string or a list of strings", param="input")
    texts = [t for t in given if isinstance(t, str)]
    if len(texts) != len(given):
        raise InvalidRequest(
            "this model takes text: 'input' as token ids is not supported (its tokenizer is not the client's)",
            param="input",
        )
    for i, t in enumerate(texts):
        if not t.strip():
            raise InvalidRequest(f"input {i} is empty", param="input")
    return texts


def _encoded(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return [float(x) for x in vector]


def _engine_models(rt: Runtime, name: str) -> list[str]:
    """The policy models down ``name``'s chain whose backends have an embeddings API."""
    if name not in public_models(rt.policy):
        return []
    chain = resolve(rt.policy, name).chain
    return [m for m in chain if rt.backends[rt.policy.models[m].backend].capabilities.embeddings]


async def embed(rt: Runtime, body: dict[str, Any], ctx: Context) -> Served:
    """The embeddings of a request's body: the encoder's, or a policy model's engine's (its
    ``/v1/embeddings`` passed through down the model's chain; a backend without one is skipped)."""
    req = check(EmbeddingsRequest, body)
    if req.model not in served_models(rt) and _engine_models(rt, req.model):
        chain = resolve(rt.policy, req.model).chain
        served = await dispatch(rt, jobs.internal("embedding", body, None, None), ctx, chain)
        assert served.completion is not None
        served.completion.body["model"] = served.model
        return served
    if req.model not in served_models(rt):
        served_names = (
            ", ".join(served_models(rt)) or "none: the policy has no classifier and no model an engine embeds with"
        )
        raise ModelNotFound(
            f"The model '{req.model}' does not serve embeddings here (served: {served_names})", param="model"
        )
    assert rt.encoding is not None
    dim = rt.encoding.classifier.encoder.dim
    if req.dimensions is not None and req.dimensions != dim:
        raise InvalidRequest(
            f"'dimensions' {req.dimensions} is not supported: {req.model} gives {dim} dimensions only",
            param="dimensions",
        )
    texts = _texts(req)
    rows = await asyncio.gather(*(rt.encoding.embedder.embed(t) for t in texts))
    tokens = sum(n for _, n in rows)
    out = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
            for i, (v, _) in enumerate(rows)
        ],
        "model": req.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return Served(req.model, ENCODER, ENCODER, completion=Completion(out, ENCODER))
