"""The ``llamacpp`` backend: generation with a GGUF file through llama-cpp-python.

The chat template comes from the GGUF file. Generation runs in the file's worker process
(``backends.engine_worker``), one request at a time per context, so a native fault in llama.cpp
costs this backend's requests in flight, never the gateway. The request is checked here, before
it is queued: what reaches the engine is only what it is known to survive.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator
from typing import Any

from backends import gguf, schema_bounds
from backends.base import Attempt, Body, Call, Capabilities, ChunkStream, Completion, Stopwatch
from backends.engine_handle import EngineHandle, open_engine
from backends.engine_host import EngineSpec
from policies.errors import InvalidRequest, UpstreamError, UpstreamTimeout

_CHAT_PARAMS = {
    "messages",
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}
_COMPLETION_PARAMS = {
    "prompt",
    "suffix",
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "seed",
    "logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}


_LITERAL = r'"(?:[^"\\\n]|\\["\\nrt/])+"'
_LITERALS = re.compile(rf"root ::= {_LITERAL}(?: \| {_LITERAL})*")


def _kwargs(call: Call) -> dict[str, Any]:
    body = call.body
    if int(body.get("n") or 1) != 1:
        raise InvalidRequest("n > 1 is not supported by the local llama.cpp backend", param="n")
    allowed = _CHAT_PARAMS if call.kind == "chat" else _COMPLETION_PARAMS
    kwargs = {k: v for k, v in body.items() if k in allowed and v is not None}
    if "max_completion_tokens" in body and "max_tokens" not in kwargs:
        kwargs["max_tokens"] = body["max_completion_tokens"]
    if call.kind == "completion" and isinstance(kwargs.get("prompt"), list):
        prompts = kwargs["prompt"]
        if len(prompts) != 1 or not isinstance(prompts[0], str):
            raise InvalidRequest("the local backend takes one prompt string", param="prompt")
        kwargs["prompt"] = prompts[0]
    if call.kind == "chat":
        kwargs.update(_constraint(body))
    kwargs["model"] = body.get("model")
    return kwargs


def _constraint(body: dict[str, Any]) -> dict[str, Any]:
    """Constrained decoding llama-cpp-python takes: a GBNF ``grammar`` (the cascade's model tier with
    ``constrain: grammar``, or a client's), and OpenAI's ``response_format: json_schema``, which it
    knows only as ``json_object`` with a ``schema`` (passed as is, it would be ignored). Every schema
    and grammar that reaches the engine passes ``backends.schema_bounds`` first (docs/operations.md,
    'Local engines'): the response format's, and each tool's ``parameters`` (a forced tool's become
    the grammar)."""
    out: dict[str, Any] = {}
    fmt = body.get("response_format")
    schema: Any = None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.json_schema.schema must be an object", param="response_format")
        where = "response_format.json_schema.schema"
    elif isinstance(fmt, dict) and fmt.get("schema") is not None:  # llama-cpp-python's own json_object + schema
        schema, where = fmt["schema"], "response_format.schema"
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{where} must be an object", param="response_format")
    if schema is not None:
        _bounded(schema, where)
        out["response_format"] = {"type": "json_object", "schema": schema}
    _check_tools(body.get("tools"), body.get("tool_choice"))
    grammar = body.get("grammar")
    if grammar is not None:
        # llama.cpp parses a grammar only when sampling starts, and a grammar that does not parse
        # aborts the process: only the shape the cascade builds (literal alternatives) is taken
        if not isinstance(grammar, str) or not _LITERALS.fullmatch(grammar):
            raise InvalidRequest(
                'grammar: the local backend takes only literal alternatives, root ::= "A" | "B" | ...',
                param="grammar",
            )
        try:
            schema_bounds.check_grammar(grammar, "grammar")
        except schema_bounds.SchemaOutOfBounds as exc:
            raise InvalidRequest(str(exc), param="grammar", code="schema_out_of_bounds") from None
        out["grammar"] = grammar  # compiled in the worker
    return out


def _bounded(schema: Any, where: str) -> None:
    try:
        schema_bounds.check(schema, where)
    except schema_bounds.SchemaOutOfBounds as exc:
        raise InvalidRequest(str(exc), param=exc.where or where, code="schema_out_of_bounds") from None


def _check_tools(tools: Any, choice: Any) -> None:
    """Each tool's ``parameters``: llama-cpp-python compiles a forced tool's into the grammar (and
    some chat formats every tool's); a ``tool_choice`` naming a function must name one of them,
    with parameters."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", param="tools")
    params: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"tools[{i}] must be a function tool with a name", param=f"tools[{i}]")
        where = f"tools[{i}].function.parameters"
        schema = params[fn["name"]] = fn.get("parameters")
        if schema is None:
            continue
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        _bounded(schema, where)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in params:
            raise InvalidRequest("tool_choice must name a function of tools", param="tool_choice")
        if params[name] is None:  # the forced tool's schema is read with no default
            raise InvalidRequest(f"the forced tool {name!r} needs parameters on the local backend", param="tools")


class LlamaCppBackend:
    """Generation in the file's supervised worker process (``backends.engine_host``)."""

    capabilities = Capabilities(n_choices=False, images=False)  # no vision projector is loaded

    def __init__(self, name: str, spec: Any) -> None:
        self.name = name
        self.spec = spec
        self.engine: EngineHandle | None = None

    async def start(self) -> None:
        path = await asyncio.to_thread(gguf.model_file, self.spec.gguf.package, self.spec.gguf.path)  # may hash 250 MB
        s = self.spec
        self.engine = EngineHandle(self.name, path, EngineSpec("chat", s.n_ctx, s.n_threads, s.n_batch, s.chat_format))
        await open_engine(self.engine)

    async def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.close()

    async def context_length(self, upstream: str) -> int | None:
        return int(self.spec.n_ctx)  # the context the engine is opened with

    def healthy(self) -> bool:
        return self.engine is not None and self.engine.healthy()

    def problem(self) -> str | None:
        """Why the engine is down (``/ready`` shows it), None while it serves."""
        return None if self.engine is None else self.engine.problem()

    def _engine(self) -> EngineHandle:
        if self.engine is None:
            raise UpstreamError(f"backend {self.name} is not loaded")
        return self.engine

    async def complete(self, call: Call) -> Completion:
        engine = self._engine()
        args = await asyncio.to_thread(_kwargs, call)  # the schema check reads a grammar: ms to tenths of s
        watch = Stopwatch()
        try:
            body = await engine.call(call.kind, args, self.spec.timeouts.total_s)
        except UpstreamTimeout:
            call.attempts.append(Attempt(self.name, "local", "timeout", watch.elapsed()))
            raise
        except UpstreamError:
            call.attempts.append(Attempt(self.name, "local", "stream_error", watch.elapsed()))
            raise
        call.attempts.append(Attempt(self.name, "local", "ok", watch.elapsed()))
        return Completion(body, "local")

    async def open_stream(self, call: Call) -> ChunkStream:
        engine = self._engine()
        args = await asyncio.to_thread(_kwargs, call)  # validated before waiting for the model, off the loop
        t = self.spec.timeouts
        watch = Stopwatch()
        chunks = engine.stream(call.kind, args, t.first_byte_s, t.idle_s, t.total_s)
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            raise UpstreamError("local generation stopped unexpectedly", retryable=False) from None
        except UpstreamTimeout:
            await chunks.aclose()
            call.attempts.append(Attempt(self.name, "local", "timeout", watch.elapsed()))
            raise
        except (InvalidRequest, UpstreamError):
            await chunks.aclose()
            raise
        call.attempts.append(Attempt(self.name, "local", "ok", watch.elapsed()))
        return ChunkStream(first, _rest(call, first, chunks), "local")


async def _rest(call: Call, first: Body, chunks: AsyncGenerator[Any, None]) -> AsyncGenerator[Body, None]:
    """The stream after its first chunk; the worker's last item is its result (the context's
    token count), which becomes the usage chunk when the client asked for one."""
    produced, cid = 1, first.get("id", "usage")
    try:
        async for item in chunks:
            if isinstance(item, dict) and "n_tokens" in item and "choices" not in item:
                if (call.body.get("stream_options") or {}).get("include_usage"):
                    yield _usage_chunk(call, cid, int(item["n_tokens"]), produced)
                return
            produced += 1
            cid = item.get("id", cid)
            yield item
    finally:
        await chunks.aclose()


def _usage_chunk(call: Call, cid: str, n_tokens: int, produced: int) -> Body:
    # llama-cpp-python's streams carry no usage: the context holds prompt + generated tokens,
    # and each streamed chunk is one generated token (the role-only first chat chunk is not).
    completion = max(produced - (1 if call.kind == "chat" else 0) - 1, 0)
    return {
        "id": cid,
        "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
        "created": 0,
        "model": call.body.get("model"),
        "choices": [],
        "usage": {
            "prompt_tokens": max(n_tokens - completion, 0),
            "completion_tokens": completion,
            "total_tokens": max(n_tokens, completion),
        },
    }


def factory(name: str, spec: Any) -> LlamaCppBackend:
    return LlamaCppBackend(name, spec)
