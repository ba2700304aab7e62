"""Hot reload: on SIGHUP or a change of the file, validate the new policy, then swap it in.

An invalid file, or one whose backends fail to start, leaves the old policy serving and logs
every problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from pathlib import Path

import structlog
import watchfiles

from gateway.obs.metrics import Metrics
from gateway.service import assemble
from gateway.service.runtime import RuntimeHolder
from policies import loader
from policies.errors import PolicyInvalid
from policies.schema import Policy

log = structlog.get_logger("triage.reload")


class Reloader:
    def __init__(
        self, path: Path, holder: RuntimeHolder, metrics: Metrics, check: Callable[[Policy], list[str]] | None = None
    ) -> None:
        """``check``: problems the process finds in a policy that validates (``--workers``: limits
        a worker would keep alone); a policy with any is rejected like an invalid one."""
        self.path = path
        self.check = check
        self.holder = holder
        self.metrics = metrics
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[object]] = set()

    async def reload(self, reason: str) -> bool:
        async with self._lock:
            try:
                policy = await asyncio.to_thread(loader.load, self.path)
                if self.check is not None and (problems := self.check(policy)):
                    raise PolicyInvalid(problems)
                new = await assemble.build(policy, self.holder.current, self.path.parent, self.path)
            except PolicyInvalid as exc:
                return self._rejected(reason, exc.problems)
            except Exception as exc:  # an edge: a model that will not load must not stop the watcher
                log.exception("policy_reload_failed", reason=reason, path=str(self.path))
                return self._rejected(reason, [f"{type(exc).__name__}: {exc}"])
            await self.holder.swap(new)
            self.metrics.reloads.labels("applied").inc()
            log.info("policy_reloaded", reason=reason, path=str(self.path))
            return True

    def _rejected(self, reason: str, problems: list[str]) -> bool:
        self.metrics.reloads.labels("rejected").inc()
        log.error("policy_reload_rejected", reason=reason, path=str(self.path), problems=problems)
        return False

    def _spawn(self, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self.reload(reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def install_sighup(self) -> bool:
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._spawn, "sighup")
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals
            return False
        return True

    def remove_sighup(self) -> None:
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    async def watch(self, stop: asyncio.Event) -> None:
        target = self.path.resolve()
        async for changes in watchfiles.awatch(target.parent, stop_event=stop, debounce=200, step=50):
            if any(Path(p).resolve() == target for _, p in changes) and target.exists():
                await self.reload("file_changed")
