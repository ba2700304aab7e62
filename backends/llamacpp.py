"""The ``llamacpp`` backend: in-process generation with a GGUF file through llama-cpp-python.

The chat template comes from the GGUF file. Generation runs in a worker thread, one request at
a time per loaded model (a llama.cpp context is not thread-safe), never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import jinja2

from backends import gguf
from backends.base import Attempt, Body, Call, Capabilities, ChunkStream, Completion, Stopwatch
from backends.registry import register
from backends.serial import Serial
from policies.errors import InvalidRequest, TriageError, UpstreamError, UpstreamTimeout

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
    knows only as ``json_object`` with a ``schema`` (passed as is, it would be ignored)."""
    out: dict[str, Any] = {}
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.json_schema.schema must be an object", param="response_format")
        out["response_format"] = {"type": "json_object", "schema": schema}
    grammar = body.get("grammar")
    if grammar is not None:
        # llama.cpp parses a grammar only when sampling starts, and a grammar that does not parse
        # aborts the process: only the shape the cascade builds (literal alternatives) is taken
        if not isinstance(grammar, str) or not _LITERALS.fullmatch(grammar):
            raise InvalidRequest(
                'grammar: the local backend takes only literal alternatives, root ::= "A" | "B" | ...',
                param="grammar",
            )
        from llama_cpp import LlamaGrammar

        out["grammar"] = LlamaGrammar.from_string(grammar, verbose=False)
    return out


class LlamaCppBackend:
    capabilities = Capabilities(n_choices=False)

    def __init__(self, name: str, spec: Any) -> None:
        self.name = name
        self.spec = spec
        self._llm: Any = None
        self._serial = Serial()

    async def start(self) -> None:
        from llama_cpp import Llama  # heavy: imported when a policy uses this backend

        path = await asyncio.to_thread(gguf.resolve, self.spec.gguf.package, self.spec.gguf.path)  # may hash 250 MB
        self._llm = await asyncio.to_thread(
            Llama,
            model_path=str(path),
            n_ctx=self.spec.n_ctx,
            n_threads=self.spec.n_threads,
            n_threads_batch=self.spec.n_threads,
            n_batch=self.spec.n_batch,
            chat_format=self.spec.chat_format,
            verbose=False,
        )

    async def close(self) -> None:
        async with self._serial.lock:  # after the generation in progress, if any
            llm, self._llm = self._llm, None
            if llm is not None:
                await asyncio.to_thread(llm.close)

    def healthy(self) -> bool:
        return self._llm is not None

    def _run(self, call: Call, stream: bool) -> Any:
        fn = self._llm.create_chat_completion if call.kind == "chat" else self._llm.create_completion
        with _mapped_errors():
            return fn(**_kwargs(call), stream=stream)

    async def complete(self, call: Call) -> Completion:
        if self._llm is None:
            raise UpstreamError(f"backend {self.name} is not loaded")
        watch = Stopwatch()
        t = self.spec.timeouts
        fut = await self._serial.submit(lambda: self._run(call, False))
        try:
            async with asyncio.timeout(t.total_s):
                body = await asyncio.shield(fut)
        except TimeoutError:
            call.attempts.append(Attempt(self.name, "local", "timeout", watch.elapsed()))
            raise UpstreamTimeout(f"local model {self.name} timed out") from None
        call.attempts.append(Attempt(self.name, "local", "ok", watch.elapsed()))
        return Completion(body, "local")

    async def open_stream(self, call: Call) -> ChunkStream:
        if self._llm is None:
            raise UpstreamError(f"backend {self.name} is not loaded")
        watch = Stopwatch()
        _kwargs(call)  # validate before waiting for the model
        chunks = self._bridge(call)
        try:
            async with asyncio.timeout(self.spec.timeouts.first_byte_s):
                first = await anext(chunks)
        except TimeoutError:
            await chunks.aclose()
            call.attempts.append(Attempt(self.name, "local", "timeout", watch.elapsed()))
            raise UpstreamTimeout(f"local model {self.name} timed out") from None
        except (InvalidRequest, UpstreamError):
            await chunks.aclose()
            raise
        call.attempts.append(Attempt(self.name, "local", "ok", watch.elapsed()))
        return ChunkStream(first, chunks, "local")

    async def _bridge(self, call: Call) -> AsyncGenerator[Body, None]:
        """Run the blocking generator in a thread; hand its chunks to the loop."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        stop = threading.Event()
        put = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)  # noqa: E731

        def work() -> None:
            try:
                with _mapped_errors():
                    for chunk in self._run(call, True):
                        if stop.is_set():
                            break
                        put(("chunk", chunk))
                put(("end", self._llm.n_tokens))
            except (InvalidRequest, UpstreamError) as exc:
                put(("error", exc))
            finally:
                put(("done", None))

        await self._serial.submit(work)
        produced, ended, cid = 0, False, "usage"
        try:
            while True:
                kind, item = await queue.get()
                if kind == "chunk":
                    produced += 1
                    cid = item.get("id", cid)
                    yield item
                elif kind == "end":
                    ended = True
                    if (call.body.get("stream_options") or {}).get("include_usage"):
                        yield _usage_chunk(call, cid, item, produced)
                elif kind == "error":
                    raise item
                elif ended:
                    return
                else:  # "done" without "end"
                    raise UpstreamError("local generation stopped unexpectedly", retryable=False)
        finally:
            stop.set()  # the thread stops at its next token; the lock goes when it has


@contextlib.contextmanager
def _mapped_errors() -> Iterator[None]:
    """The thread edge: llama-cpp-python's errors become the gateway's. A request it cannot take
    (context overflow, a template that refuses the messages, malformed tools) is the client's;
    anything else the engine raises is an upstream failure, never an unhandled 500."""
    try:
        yield
    except TriageError:
        raise
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
        raise InvalidRequest(f"the local model cannot take this request: {exc}") from None
    except Exception as exc:  # the edge between the engine's thread and the gateway
        raise UpstreamError(f"local generation failed: {exc}", retryable=False) from None


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


@register("llamacpp")
def _build(name: str, spec: Any) -> LlamaCppBackend:
    return LlamaCppBackend(name, spec)
