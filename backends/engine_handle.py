"""What a backend holds of a local engine: its engine on its file's one worker process
(:mod:`backends.engine_host`, shared by every backend on that file in the event loop), opened,
called and streamed through the host; and opening one so that a file that does not load leaves
its backend unhealthy with the reason instead of stopping the gateway."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import structlog

from backends.engine_host import EngineSpec, host_for
from policies.errors import EngineUnavailable

log = structlog.get_logger("triage.engines")


class EngineHandle:
    """What a backend holds: its engine on its file's worker."""

    def __init__(self, backend: str, path: Path, spec: EngineSpec) -> None:
        self.backend = backend
        self.spec = spec
        self.host = host_for(path)
        self.eid = f"{backend}:{id(self):x}"

    async def open(self) -> None:
        try:
            await self.host.open(self.eid, self.spec)
        except EngineUnavailable:
            raise  # kept: unhealthy, with the reason, until the policy is loaded again
        except BaseException:
            await self.host.close_engine(self.eid)
            raise

    async def close(self) -> None:
        await self.host.close_engine(self.eid)

    def healthy(self) -> bool:
        return self.host.healthy(self.eid)

    def problem(self) -> str | None:
        return self.host.problem(self.eid)

    async def call(self, method: str, args: dict[str, Any], timeout_s: float) -> Any:
        return await self.host.call(self.eid, method, args, timeout_s)

    def stream(
        self, method: str, args: dict[str, Any], first_byte_s: float, idle_s: float, total_s: float
    ) -> AsyncGenerator[Any, None]:
        return self.host.stream(self.eid, method, args, first_byte_s, idle_s, total_s)


async def open_engine(handle: EngineHandle) -> None:
    """Open a backend's engine. One that does not load (a truncated file, a kernel that faults
    on the first token) leaves its backend unhealthy with the reason, logged; the gateway starts
    and serves everything else (``/ready`` names it)."""
    try:
        await handle.open()
    except EngineUnavailable as exc:
        log.error("engine_unavailable", backend=handle.backend, reason=exc.message)
