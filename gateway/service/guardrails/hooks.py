"""An operator's own check: an HTTP endpoint, or a Python entry point an installed package
registers in the ``triage.guardrails`` group (found by its name, never a module path from YAML).

HTTP: ``POST url`` with ``{"guardrail", "stage", "text", "key", "team"}``; the answer is
``{"flagged": bool, "reason": str}`` (a 2xx; anything else is the hook failing). An entry point is
a callable ``(text, stage) -> bool | str | dict | None`` (a coroutine function too): true, a
reason, or ``{"flagged": true, "reason": ...}`` flag the text. Either has the guardrail's deadline;
a sync entry point runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import httpx

from policies.errors import UpstreamError
from policies.schema_guardrails import HookGuardrail
from policies.secrets import resolve_secret

GROUP = "triage.guardrails"


@dataclass(frozen=True)
class Flag:
    flagged: bool
    reason: str | None = None


def load_entry_point(name: str) -> Callable[..., Any]:
    """The callable registered as ``name`` in the ``triage.guardrails`` group (LookupError: none)."""
    found = entry_points(group=GROUP, name=name)
    if not found:
        raise LookupError(f"no entry point '{name}' in the {GROUP} group (is its package installed?)")
    fn = next(iter(found)).load()
    if not callable(fn):
        raise LookupError(f"entry point '{name}' in the {GROUP} group is not callable")
    return fn


class Hook:
    def __init__(self, name: str, spec: HookGuardrail, fn: Callable[..., Any] | None = None) -> None:
        self.name, self.spec = name, spec
        self.fn = fn if fn is not None or spec.entry_point is None else load_entry_point(spec.entry_point)
        self.headers = {k: v for k, raw in spec.headers.items() if (v := resolve_secret(raw)) is not None}

    async def ask(self, text: str, stage: str, key: str | None, team: str | None) -> Flag:
        """The hook's answer, within its deadline (TimeoutError past it; UpstreamError for an answer
        that is not one)."""
        return await asyncio.wait_for(self._ask(text, stage, key, team), self.spec.timeout_s)

    async def _ask(self, text: str, stage: str, key: str | None, team: str | None) -> Flag:
        if self.fn is not None:
            if inspect.iscoroutinefunction(self.fn):
                said = await self.fn(text, stage)
            else:
                said = await asyncio.to_thread(self.fn, text, stage)
            return _flag(said)
        assert self.spec.url is not None
        payload = {"guardrail": self.name, "stage": stage, "text": text, "key": key, "team": team}
        async with httpx.AsyncClient(timeout=self.spec.timeout_s) as client:
            r = await client.post(self.spec.url, json=payload, headers=self.headers)
        if r.status_code // 100 != 2:
            raise UpstreamError(f"hook answered {r.status_code}", retryable=False)
        try:
            doc = r.json()
        except ValueError as exc:
            raise UpstreamError("hook answered no JSON", retryable=False) from exc
        return _flag(doc)


def _flag(said: Any) -> Flag:
    if said is None or said is False:
        return Flag(False)
    if said is True:
        return Flag(True)
    if isinstance(said, str):
        return Flag(True, said[:200])
    if isinstance(said, dict) and isinstance(said.get("flagged"), bool):
        reason = said.get("reason")
        return Flag(said["flagged"], str(reason)[:200] if reason else None)
    raise UpstreamError(f"hook answered {type(said).__name__}, not a verdict", retryable=False)
