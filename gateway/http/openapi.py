"""The OpenAPI 3.1 document of every route, request and response bodies from pydantic models.

The hot routes are plain Starlette routes and the Batch API reads its bodies itself, so FastAPI
cannot see their bodies: each operation is listed here once (``OPERATIONS``), and the test checks
that every route the app serves is in it. Response models are open (``extra="allow"``): they name
the fields triage always sends, and an engine's extra fields pass through.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from gateway.http.anthropic_messages import MessagesRequest
from gateway.http.responses import ResponsesRequest
from gateway.service.bodies import BatchCreate, ChatRequest, CompletionRequest, FeedbackRequest
from gateway.service.decisions import DecideRequest
from gateway.service.embeddings import EmbeddingsRequest


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Open):
    """Every error: OpenAI's shape."""

    error: ErrorDetail


class AnthropicErrorDetail(_Open):
    type: str
    message: str


class AnthropicErrorBody(_Open):
    """Errors of /v1/messages: Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class TextCompletion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class DecideBatchRequest(BaseModel):
    """``/v1/decide/batch``: the questions (a bare JSON list of them is taken too)."""

    model_config = ConfigDict(extra="forbid")
    questions: list[DecideRequest] = Field(min_length=1)


class DecisionBody(_Open):
    id: str
    object: Literal["decision"]
    answer: Any
    probabilities: dict[str, float]
    confidence: float
    probabilities_measured: bool
    tier: str
    trace: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class FileUpload(BaseModel):
    """``POST /v1/files``, multipart/form-data."""

    file: bytes = Field(json_schema_extra={"format": "binary"})
    purpose: Literal["batch"]
    expires_after_anchor: Literal["created_at"] | None = Field(None, alias="expires_after[anchor]")
    expires_after_seconds: int | None = Field(None, alias="expires_after[seconds]", ge=1, le=2_592_000)


class FileObject(_Open):
    id: str
    object: Literal["file"]
    purpose: str
    filename: str
    bytes: int
    created_at: int
    status: str
    expires_at: int | None


class FileDeleted(_Open):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(_Open):
    total: int
    completed: int
    failed: int


class BatchObject(_Open):
    id: str
    object: Literal["batch"]
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    request_counts: RequestCounts
    metadata: dict[str, Any] | None = None


class BatchList(_Open):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class Embedding(_Open):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingList(_Open):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: dict[str, int]


class ResponseObject(_Open):
    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseDeleted(_Open):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class MessageObject(_Open):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    usage: dict[str, int]


class FeedbackBody(_Open):
    object: Literal["feedback"]
    request_id: str
    verdict: Literal["right", "wrong"] | None
    score: float | None


class Health(_Open):
    status: Literal["ok"]


class Ready(_Open):
    status: Literal["ready", "not_ready"]
    backends: dict[str, bool]


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    summary: str
    request: type[BaseModel] | None  # None: no body
    response: type[BaseModel] | str  # a model, or a media type of its own ("text/plain", ...)
    errors: tuple[int, ...] = (400, 401, 413, 429, 502, 504)
    multipart: bool = False
    sse: bool = False  # with stream: true the answer is text/event-stream
    error_body: type[BaseModel] | None = None  # None: OpenAI's ErrorBody


OPERATIONS = (
    Op("POST", "/v1/chat/completions", "Chat completion (plain, or SSE with stream: true)", ChatRequest,
       ChatCompletion, sse=True),
    Op("POST", "/v1/completions", "Text completion (plain, or SSE with stream: true)", CompletionRequest,
       TextCompletion, sse=True),
    Op("POST", "/v1/decide", "A typed decision through the cascade", DecideRequest, DecisionBody,
       (400, 401, 404, 413, 429, 502, 504)),
    Op("POST", "/v1/decide/batch", "Typed decisions, each its own answer or error", DecideBatchRequest,
       DecisionBody, (400, 401, 404, 413, 429)),
    Op("POST", "/v1/embeddings", "Embeddings from the policy's encoder", EmbeddingsRequest, EmbeddingList,
       (400, 401, 404, 413, 429)),
    Op("POST", "/v1/feedback", "A verdict on one of the caller's requests (policy: quality)", FeedbackRequest,
       FeedbackBody, (400, 401, 404, 413, 429, 503)),
    Op("POST", "/v1/responses", "A response (the Responses API, on the chat pipeline; SSE events with stream: true)",
       ResponsesRequest, ResponseObject, (400, 401, 404, 413, 429, 502, 504), sse=True),
    Op("POST", "/v1/messages", "Anthropic's Messages API, on the chat pipeline (errors in Anthropic's shape)",
       MessagesRequest, MessageObject, (400, 401, 404, 413, 429, 502, 504), sse=True,
       error_body=AnthropicErrorBody),
    Op("GET", "/v1/responses/{response_id}", "A stored response", None, ResponseObject, (401, 404)),
    Op("DELETE", "/v1/responses/{response_id}", "Delete a stored response", None, ResponseDeleted, (401, 404)),
    Op("GET", "/v1/models", "The policy's models", None, ModelList, (401,)),
    Op("GET", "/v1/models/{model}", "One model", None, ModelCard, (401, 404)),
    Op("POST", "/v1/files", "Upload a batch input file", FileUpload, FileObject, (400, 401, 408, 413, 503),
       multipart=True),
    Op("GET", "/v1/files/{file_id}", "A file", None, FileObject, (401, 404, 503)),
    Op("DELETE", "/v1/files/{file_id}", "Delete a file", None, FileDeleted, (401, 404, 503)),
    Op("GET", "/v1/files/{file_id}/content", "A file's bytes", None, "application/jsonl", (401, 404, 503)),
    Op("POST", "/v1/batches", "Create a batch", BatchCreate, BatchObject, (400, 401, 404, 413, 503)),
    Op("GET", "/v1/batches", "Batches, newest first", None, BatchList, (400, 401, 503)),
    Op("GET", "/v1/batches/{batch_id}", "A batch", None, BatchObject, (401, 404, 503)),
    Op("POST", "/v1/batches/{batch_id}/cancel", "Cancel a batch", None, BatchObject, (401, 404, 503)),
    Op("GET", "/health", "Liveness", None, Health, ()),
    Op("GET", "/ready", "Readiness: every model has a healthy backend", None, Ready, ()),
    Op("GET", "/metrics", "Prometheus text", None, "text/plain", (401,)),
)  # fmt: skip

_QUERY = {
    "/v1/batches": [
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    ]
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _operation(op: Op) -> dict[str, Any]:
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in (part[1:-1] for part in op.path.split("/") if part.startswith("{"))
    ] + _QUERY.get(op.path, [])
    if isinstance(op.response, str):
        ok = {op.response: {"schema": {"type": "string"}}}
    else:
        ok = {"application/json": {"schema": _ref(op.response)}}
        if op.sse:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
    doc: dict[str, Any] = {
        "operationId": _op_id(op.method, op.path),
        "summary": op.summary,
        "responses": {
            "200": {"description": "OK", "content": ok},
            **{
                str(status): {
                    "description": "error",
                    "content": {"application/json": {"schema": _ref(op.error_body or ErrorBody)}},
                }
                for status in op.errors
            },
        },
    }
    if params:
        doc["parameters"] = params
    if (op.method, op.path) in _LINKS:
        doc["responses"]["200"]["links"] = _LINKS[(op.method, op.path)]
    if op.request is not None:
        media = "multipart/form-data" if op.multipart else "application/json"
        doc["requestBody"] = {"required": True, "content": {media: {"schema": _ref(op.request)}}}
    return doc


def _op_id(method: str, path: str) -> str:
    return method.lower() + path.replace("/", "_").replace("{", "").replace("}", "")


# OpenAPI links: what one operation's answer feeds to the next (stateful fuzzing follows them)
_BATCH_FROM_FILE = {
    "input_file_id": "$response.body#/id",
    "endpoint": "/v1/chat/completions",
    "completion_window": "24h",
}


def _by_id(method: str, path: str) -> dict[str, Any]:
    """A link to the operation at ``path`` whose one path parameter is the answer's ``id``."""
    param = path.rsplit("{", 1)[1].split("}", 1)[0]
    return {"operationId": _op_id(method, path), "parameters": {param: "$response.body#/id"}}


_LINKS: dict[tuple[str, str], dict[str, dict[str, Any]]] = {
    ("POST", "/v1/files"): {
        "GetFile": _by_id("GET", "/v1/files/{file_id}"),
        "GetFileContent": _by_id("GET", "/v1/files/{file_id}/content"),
        "CreateBatch": {"operationId": _op_id("POST", "/v1/batches"), "requestBody": _BATCH_FROM_FILE},
        "DeleteFile": _by_id("DELETE", "/v1/files/{file_id}"),
    },
    ("POST", "/v1/batches"): {
        "GetBatch": _by_id("GET", "/v1/batches/{batch_id}"),
        "CancelBatch": _by_id("POST", "/v1/batches/{batch_id}/cancel"),
    },
    ("POST", "/v1/responses"): {
        "GetResponse": _by_id("GET", "/v1/responses/{response_id}"),
        "DeleteResponse": _by_id("DELETE", "/v1/responses/{response_id}"),
        "ContinueResponse": {
            "operationId": _op_id("POST", "/v1/responses"),
            "requestBody": {
                "model": "$request.body#/model",
                "input": "and then?",
                "previous_response_id": "$response.body#/id",
            },
        },
    },
}


@functools.lru_cache(maxsize=4)
def document_bytes(title: str, version: str, keys: bool, public_metrics: bool) -> bytes:
    return orjson.dumps(document(title, version, keys, public_metrics))


def document(title: str, version: str, keys: bool, public_metrics: bool = False) -> dict[str, Any]:
    models = {m for op in OPERATIONS for m in (op.request, op.response, op.error_body) if isinstance(m, type)}
    models |= {ErrorBody}
    modes: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        (m, "validation" if m in {op.request for op in OPERATIONS} else "serialization") for m in models
    ]
    _, schemas = models_json_schema(
        sorted(modes, key=lambda x: x[0].__name__), ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op)
        if keys and (op.path in ("/health", "/ready") or (op.path == "/metrics" and public_metrics)):
            paths[op.path][op.method.lower()]["security"] = []  # served without a key
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {})},
    }
    if keys:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
