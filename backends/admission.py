"""Online prefix admission: requests wait in the gateway for a replica slot, and a freed slot
takes the waiting request whose prompt that replica's cache holds.

Without it, online requests go to a replica as they arrive (round robin, least outstanding, or
the hash of ``prefix_affinity_chars``) and queue inside the engine in arrival order: two
requests sharing a few-shot template land on different replicas, or between two of another
template, and each evaluates the template again. With ``admission`` a remote backend lets at
most ``slots`` requests per replica through (the engine's parallel slots) and keeps the rest.
When a slot frees, :func:`choose` hands out the waiting requests:

1. a request that younger requests have overtaken ``max_skips`` times goes first (oldest first),
   to the free replica whose recent prompts share most with it: no request starves;
2. then the (request, free replica) pair sharing the most prompt tokens, if at least
   ``min_shared_tokens``: requests of one template run back to back on the replica that holds it;
3. then, oldest first, a request that no busy replica holds goes to the free replica whose cache
   the waiting requests want least; one that a busy replica holds waits for it while it is
   younger than ``window_ms`` (0, the default: never; a replica then idles while work waits,
   which did not pay on one-slot engines: see the README).

A replica's cache, as far as the gateway can tell, is the last ``cached_prompts`` prompts it was
given. Prompts are compared as :func:`backends.prefix.approx_tokens` (no tokenizer on the hot path).
Everything runs on the event loop, in :meth:`Admission.acquire` and a slot's release; the choice
itself is a pure function.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backends.prefix import approx_tokens, shared_tokens, sort_key
from backends.replicas import ReplicaSet, ReplicaState
from policies.errors import UpstreamTimeout


@dataclass(frozen=True)
class Waiting:
    key: bytes  # the prompt as a sort key (backends.prefix.sort_key)
    arrived: float
    skipped: int = 0  # times a younger request was given a slot first


@dataclass(frozen=True)
class View:
    free: int  # slots free now (0 when the replica is busy)
    recent: tuple[bytes, ...]  # the prompts its cache is assumed to hold, newest first
    up: bool = True  # available (a replica that is down is neither free nor worth waiting for)


SCAN = 64  # waiting requests (the oldest) considered in one choice: bounds its cost on the event loop


def choose(
    waiting: Sequence[Waiting],
    replicas: Sequence[View],
    now: float,
    *,
    max_skips: int,
    window_s: float,
    min_shared: int,
) -> list[tuple[int, int]]:
    """Which waiting requests (indices, in arrival order) go to which replicas now, by the rules
    in the module's docstring. Each replica gets at most its free slots; a request at most once.
    Only the oldest :data:`SCAN` waiting requests are considered."""
    free = {r: v.free for r, v in enumerate(replicas) if v.up and v.free > 0}
    left = list(range(min(len(waiting), SCAN)))
    skipped = [w.skipped for w in waiting]
    out: list[tuple[int, int]] = []
    memo: dict[tuple[int, int], int] = {}

    def warmth(w: int, r: int) -> int:
        if (w, r) not in memo:
            memo[w, r] = max((shared_tokens(waiting[w].key, k) for k in replicas[r].recent), default=0)
        return memo[w, r]

    def give(w: int, r: int) -> None:
        out.append((w, r))
        left.remove(w)
        for older in left:
            if older < w:
                skipped[older] += 1
        free[r] -= 1
        if not free[r]:
            del free[r]

    while free and left:
        late = next((w for w in left if skipped[w] >= max_skips), None)
        if late is not None:  # rule 1
            give(late, max(free, key=lambda r: (warmth(late, r), free[r], -r)))
            continue
        score, w, r = max(((warmth(w, r), w, r) for w in left for r in free), key=lambda t: (t[0], -t[1], -t[2]))
        if score >= min_shared:  # rule 2
            give(w, r)
            continue
        busy = [r for r, v in enumerate(replicas) if v.up and r not in free]
        cold = next(
            (w for w in left if now - waiting[w].arrived >= window_s or all(warmth(w, r) < min_shared for r in busy)),
            None,
        )
        if cold is None:  # rule 3: every request left waits, within its window, for a busy replica holding its prefix
            break
        give(cold, min(free, key=lambda r: (sum(warmth(w, r) >= min_shared for w in left), -free[r], r)))
    return out


@dataclass(eq=False)
class _Entry:
    key: bytes
    arrived: float
    future: asyncio.Future[int]
    skipped: int = 0


@dataclass(eq=False)
class _Replica:
    state: ReplicaState
    in_flight: int = 0
    recent: deque[bytes] = field(default_factory=deque)


class Slot:
    """A replica slot held for one call; :meth:`release` (idempotent) hands it on."""

    def __init__(self, admission: Admission, index: int) -> None:
        self._admission = admission
        self._index = index
        self.replica = admission.replicas[index].state
        self._done = False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._admission.release(self._index)


class Admission:
    """The waiting room in front of one remote backend's replicas."""

    def __init__(
        self,
        replicas: ReplicaSet,
        *,
        slots: int,
        max_skips: int,
        window_ms: float,
        cached_prompts: int,
        min_shared_tokens: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicas = [_Replica(r) for r in replicas.replicas]
        self._set = replicas
        self.slots = slots
        self.max_skips = max_skips
        self.window_s = window_ms / 1000
        self.cached = cached_prompts
        self.min_shared = min_shared_tokens
        self.clock = clock
        self._queue: list[_Entry] = []
        self._timer: asyncio.TimerHandle | None = None
        self._views: list[View] = []

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def acquire(self, prompt: str, timeout_s: float) -> Slot:
        """Wait (at most ``timeout_s``) for a slot on the replica :func:`choose` gives this prompt."""
        entry = _Entry(sort_key(approx_tokens(prompt)), self.clock(), asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        self._pump()
        try:
            async with asyncio.timeout(timeout_s):
                index = await asyncio.shield(entry.future)
        except BaseException as exc:
            if entry in self._queue:
                self._queue.remove(entry)
            elif entry.future.done() and not entry.future.cancelled():
                self.release(entry.future.result())  # given a slot as we gave up: hand it on
            if isinstance(exc, TimeoutError):
                raise UpstreamTimeout(f"no replica slot free within {timeout_s:g} s") from None
            raise
        return Slot(self, index)

    def release(self, index: int) -> None:
        self.replicas[index].in_flight -= 1
        self._pump()

    def _pump(self) -> None:
        if not self._queue:
            return
        now = self.clock()
        up = [r.state.available(now) for r in self.replicas]
        if not any(up):  # none is known good: any replica may take the call (its retries decide)
            up = [True] * len(self.replicas)
        views = [
            View(max(0, self.slots - r.in_flight), tuple(reversed(r.recent)), ok)
            for r, ok in zip(self.replicas, up, strict=True)
        ]
        self._views = views
        picks = choose(
            [Waiting(e.key, e.arrived, e.skipped) for e in self._queue],
            views,
            now,
            max_skips=self.max_skips,
            window_s=self.window_s,
            min_shared=self.min_shared,
        )
        for i, entry in enumerate(self._queue):
            entry.skipped += sum(w > i for w, _ in picks)
        given = [self._queue[w] for w, _ in picks]
        for (_, r), entry in zip(picks, given, strict=True):
            rep = self.replicas[r]
            rep.in_flight += 1
            rep.recent.append(entry.key)
            while len(rep.recent) > self.cached:
                rep.recent.popleft()
            entry.future.set_result(r)
        for entry in given:
            self._queue.remove(entry)
        self._arm(now)

    def _arm(self, now: float) -> None:
        """Wake up when the oldest held request's window ends, if a replica that is up has a free
        slot then (otherwise a release wakes the queue; a timer due now would only spin)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._queue or not any(v.up and v.free for v in self._views):
            return
        due = min(e.arrived for e in self._queue[:SCAN]) + self.window_s
        if due > now:
            self._timer = asyncio.get_running_loop().call_later(due - now, self._pump)
