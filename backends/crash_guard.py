"""What a local engine's crashes teach the gateway: a request that crashed an engine is not sent
into another crash, and a key that keeps crashing engines is slowed.

When an engine's worker dies (``backends.engine_host``), every job it was running is a suspect: a
job running alone takes the whole blame (1), two jobs running side by side (a chat context and a
scorer context on one file) half each. A request's **fingerprint** is a hash of what reached the
engine: the engine's kind, the method and the content-bearing fields of its arguments (the
messages or prompt, tools, response format, grammar; not the model name nor the sampling knobs,
so a client's retry, or a retry at another temperature, is the same request). A fingerprint with a
blame of 1 within ``REQUEST_TTL_S`` is refused before it reaches an engine
(:class:`~policies.errors.CrashingRequest`, 400 ``request_crashed_engine``), and the refusal is
logged (``engine_request_refused``). A key whose blame reaches ``KEY_CRASHES`` within
``KEY_WINDOW_S`` is refused by every local engine for ``KEY_COOLDOWN_S``
(:class:`~policies.errors.CrashCooldown`, 429 ``engine_crash_cooldown`` with ``Retry-After``;
logged as ``engine_key_cooldown``). Requests without a key are judged by their fingerprint only.

Who asks is the context variable :data:`CALLER`, set by the gateway's service around each
request (a batch line: its batch's owner). One guard per event loop (a gateway), in memory: with
``--workers N`` each worker process keeps its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson
import structlog

from policies.errors import CrashCooldown, CrashingRequest

log = structlog.get_logger("triage.engines")

REQUEST_TTL_S = 600.0  # a fingerprint that crashed an engine is refused this long after its last crash
KEY_WINDOW_S = 300.0  # a key's crashes are counted over this window
KEY_CRASHES = 3.0  # this much blame within the window ...
KEY_COOLDOWN_S = 120.0  # ... and the key is refused by local engines this long

# Arguments that do not change what the engine is asked (sampling knobs, the model's name): left
# out of the fingerprint, so that the same content sent again at another temperature is refused too.
NOT_CONTENT = frozenset(
    {"model", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "presence_penalty", "frequency_penalty"}
)
# A native assertion names code (file:line and a condition), never a request's content.
_ASSERTION = re.compile(r"[\w./\\-]+:\d+: GGML_ASSERT\(.{0,200}\) failed")


class Caller(NamedTuple):
    """Who asks: the key's name (for logs) and its identity (the key's sha256, or its reference)."""

    name: str
    id: str


CALLER: ContextVar[Caller | None] = ContextVar("triage_engine_caller", default=None)


@contextlib.contextmanager
def calling(caller: Caller | None) -> Iterator[None]:
    """Jobs submitted inside are ``caller``'s."""
    token = CALLER.set(caller)
    try:
        yield
    finally:
        CALLER.reset(token)


def fingerprint(kind: str, method: str, args: dict[str, Any]) -> str:
    content = {k: v for k, v in args.items() if k not in NOT_CONTENT}
    data = orjson.dumps([kind, method, content], option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    return hashlib.sha256(data).hexdigest()


class Suspect(NamedTuple):
    """A job that was running when its worker died."""

    fingerprint: Callable[[], str]  # computed only when needed: most jobs never see a crash
    caller: Caller | None


@dataclass
class _Blame:
    total: float = 0.0
    last: float = 0.0


@dataclass(eq=False)
class CrashGuard:
    """The crashes of one gateway's local engines: fingerprints and keys under suspicion."""

    log_content: bool = False  # the policy's logging.log_prompts: whether crash logs may show the worker's stderr
    clock: Callable[[], float] = time.monotonic
    _requests: dict[str, _Blame] = field(default_factory=dict)
    _keys: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)  # (when, blame)
    _cooling: dict[str, float] = field(default_factory=dict)  # key id -> refused until

    def admit(self, model: str, fingerprint: Callable[[], str]) -> None:
        """Raise when the caller is cooling down or this request crashed an engine lately."""
        now, caller = self.clock(), CALLER.get()
        if caller is not None and (until := self._cooling.get(caller.id)) is not None:
            if now < until:
                log.warning("engine_request_refused", model=model, reason="key_cooldown", key=caller.name)
                raise CrashCooldown(
                    f"the key '{caller.name}' crashed local engines {KEY_CRASHES:g} times within "
                    f"{KEY_WINDOW_S:g}s: they refuse its requests for {until - now:.0f}s more",
                    retry_after=until - now,
                )
            del self._cooling[caller.id]
        if not self._requests:
            return  # nothing is suspect: no hashing on the path of every request
        self._forget(now)
        fp = fingerprint()
        blame = self._requests.get(fp)
        if blame is not None and blame.total >= 1.0:
            log.warning(
                "engine_request_refused",
                model=model,
                reason="crashed_engine",
                fingerprint=fp[:16],
                key=caller.name if caller is not None else None,
            )
            raise CrashingRequest(
                f"this request crashed the local model {model} moments ago; the same request is refused "
                f"for {REQUEST_TTL_S:g}s after its last crash rather than sent into another crash"
            )

    def crashed(self, model: str, suspects: Iterable[Suspect]) -> None:
        """A worker died with ``suspects`` running: each takes its share of the blame."""
        running = list(suspects)
        if not running:
            return
        now, share = self.clock(), 1.0 / len(running)
        self._forget(now)
        for s in running:
            fp = s.fingerprint()
            blame = self._requests.setdefault(fp, _Blame())
            blame.total, blame.last = blame.total + share, now
            if s.caller is not None:
                self._blame_key(model, s.caller, share, now)

    def _blame_key(self, model: str, caller: Caller, share: float, now: float) -> None:
        crashes = self._keys.setdefault(caller.id, deque())
        crashes.append((now, share))
        while crashes and crashes[0][0] < now - KEY_WINDOW_S:
            crashes.popleft()
        total = sum(b for _, b in crashes)
        if total >= KEY_CRASHES:
            self._cooling[caller.id] = now + KEY_COOLDOWN_S
            crashes.clear()
            log.warning(
                "engine_key_cooldown",
                model=model,
                key=caller.name,
                crashes=round(total, 2),
                window_s=KEY_WINDOW_S,
                cooldown_s=KEY_COOLDOWN_S,
            )

    def _forget(self, now: float) -> None:
        for fp in [fp for fp, b in self._requests.items() if b.last < now - REQUEST_TTL_S]:
            del self._requests[fp]
        for kid in [kid for kid, c in self._keys.items() if not c or c[-1][0] < now - KEY_WINDOW_S]:
            del self._keys[kid]

    def stderr(self, lines: Iterable[str]) -> dict[str, Any]:
        """The worker's last words for the crash log: whole with ``log_content`` (llama.cpp may print
        a request's grammar), else only native assertions (code locations) and how many lines."""
        tail = list(lines)
        if self.log_content:
            return {"stderr": tail}
        return {"stderr": [m.group(0) for line in tail if (m := _ASSERTION.search(line))], "stderr_lines": len(tail)}


_GUARDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CrashGuard] = weakref.WeakKeyDictionary()


def guard() -> CrashGuard:
    """This event loop's guard (a gateway's; tests run several, one per loop)."""
    loop = asyncio.get_running_loop()
    found = _GUARDS.get(loop)
    if found is None:
        found = _GUARDS[loop] = CrashGuard()
    return found
