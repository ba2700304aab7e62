"""Each replica's own figures, read at a short interval: the task that feeds
:meth:`backends.replicas.ReplicaSet.observe` with what each engine's metrics endpoint says.

An engine whose endpoint does not answer within ``timeout_s``, answers an error, or answers
something that gives no load counts as **unknown**, never as idle: the rule then counts only this
gateway's own requests on it. The change from known to unknown (and back) is a log event, with
the reason; each failed read is counted on the replica (``signals_failed``, the
``triage_engine_signals_failed_total`` metric). The reads of one round run at once; a round never
overlaps the next.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

from backends.engine_load import EngineKind, EngineLoad, Malformed, parse
from backends.replicas import ReplicaSet, ReplicaState

log = structlog.get_logger("triage.backend")

Fetch = Callable[[ReplicaState, str], Awaitable[tuple[int, str, bytes]]]  # (status, content type, body)


class EnginePoller:
    def __init__(
        self,
        backend: str,
        replicas: ReplicaSet,
        fetch: Fetch,
        kind: EngineKind,
        path: str,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self.backend = backend
        self.replicas = replicas
        self.fetch = fetch
        self.kind: EngineKind = kind
        self.path = path
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failed: dict[str, int] = {r.api_base: 0 for r in replicas.replicas}  # reads that gave nothing
        self.marked_down: dict[str, bool] = {}  # replicas this poller took down (refused): it brings them back
        self._why: dict[str, str | None] = {r.api_base: None for r in replicas.replicas}  # None: known
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"engine-signals:{self.backend}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)

    async def poll(self) -> None:
        """One round: every replica read once."""
        await asyncio.gather(*(self._one(r) for r in self.replicas.replicas))

    async def _one(self, replica: ReplicaState) -> None:
        load: EngineLoad | None = None
        why: str | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                status, ctype, body = await self.fetch(replica, self.path)
            if status >= 400:
                why = f"HTTP {status}"
            else:
                load = parse(self.kind, ctype, body)
        except TimeoutError:
            why = f"no answer within {self.timeout_s:g} s"
        except Malformed as exc:
            why = f"malformed: {exc}"[:200]
        except ConnectionError as exc:
            why = f"{type(exc).__name__}: {exc}"[:200]
            if getattr(exc, "refused", False) or isinstance(exc, ConnectionRefusedError):
                self._down(replica)  # nothing listens: the engine is down, skipped from now on
        except (OSError, ValueError) as exc:  # a broken answer
            why = f"{type(exc).__name__}: {exc}"[:200]
        if why is not None:
            self.failed[replica.api_base] += 1
        elif not replica.active_ok and self.marked_down.pop(replica.api_base, False):
            replica.active_ok = True  # it answers again (the health check would say so too)
            log.info("replica_health", backend=self.backend, replica=replica.api_base, healthy=True)
        self.replicas.observe(replica, load)
        if why != self._why[replica.api_base] and (why is None or self._why[replica.api_base] is None):
            if why is None:
                log.info("engine_signals_known", backend=self.backend, replica=replica.api_base, engine=self.kind)
            else:
                log.warning(
                    "engine_signals_unknown",
                    backend=self.backend,
                    replica=replica.api_base,
                    engine=self.kind,
                    reason=why,
                    fallback="the gateway's own count of requests",
                )
        self._why[replica.api_base] = why

    def _down(self, replica: ReplicaState) -> None:
        """Taken out at once, not at the next health check; brought back by the first good read."""
        self.marked_down[replica.api_base] = True
        if replica.active_ok:
            log.warning("replica_health", backend=self.backend, replica=replica.api_base, healthy=False)
        replica.active_ok = False
