"""What the local engines that serve no chat share (the cascade's ``gguf_scorer``, the router's
``gguf_probe``): a backend started and closed by the runtime like the others, kept across reloads
when its spec is unchanged, whose engine runs in its file's worker process
(``backends.engine_host``). A model that points at one fails validation, and ``complete`` refuses.
"""

from __future__ import annotations

import asyncio
from typing import Any

from backends import gguf
from backends.base import Call, Capabilities, ChunkStream, Completion
from backends.engine_handle import EngineHandle, open_engine
from backends.engine_host import EngineSpec
from policies.errors import InvalidRequest, UpstreamError, UpstreamTimeout


class LocalEngineBackend:
    capabilities = Capabilities(
        chat=False, completions=False, streaming=False, n_choices=False, tools=False, images=False, json_schema=False
    )
    what = "serves no chat"  # for the refusal: "backend NAME <what>; it does not generate"
    label = "engine"  # for errors: "<label> NAME timed out"

    def __init__(self, name: str, spec: Any) -> None:
        self.name = name
        self.spec = spec
        self.engine: EngineHandle | None = None

    def engine_spec(self) -> EngineSpec:
        raise NotImplementedError

    async def start(self) -> None:
        path = await asyncio.to_thread(gguf.model_file, self.spec.gguf.package, self.spec.gguf.path)
        self.engine = EngineHandle(self.name, path, self.engine_spec())
        await open_engine(self.engine)

    async def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.close()

    def healthy(self) -> bool:
        return self.engine is not None and self.engine.healthy()

    async def context_length(self, upstream: str) -> int | None:
        return int(self.spec.n_ctx)

    def problem(self) -> str | None:
        """Why the engine is down (``/ready`` shows it), None while it serves."""
        return None if self.engine is None else self.engine.problem()

    async def call(self, method: str, args: dict[str, Any], timeout_s: float) -> Any:
        if self.engine is None:
            raise UpstreamError(f"{self.label} {self.name} is not loaded")
        try:
            return await self.engine.call(method, args, timeout_s)
        except UpstreamTimeout:
            raise UpstreamTimeout(f"{self.label} {self.name} timed out after {timeout_s:g}s") from None

    async def complete(self, call: Call) -> Completion:
        raise InvalidRequest(f"backend {self.name} {self.what}; it does not generate")

    async def open_stream(self, call: Call) -> ChunkStream:
        raise InvalidRequest(f"backend {self.name} {self.what}; it does not generate")
