"""Replica choice and health: the dispatch rule over each replica's load and cache, passive
ejection, active checks' bookkeeping.

State, no I/O: the remote backends (and the fleet simulator) drive it: they count requests in and
out, and hand in what each engine said of its load (``backends/engine_poll.py``). The rule itself
is :func:`policies.dispatch.choose`. ``clock`` is injectable for tests.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from backends.engine_load import EngineLoad
from policies.dispatch import BALANCE, SLACK, PrefixIndex, Strategy, View, choose, covered, index_hashes, key_of, rank

MIN_BLOCK_BYTES = 256  # the index's smallest block (64 tokens at 4 bytes a token)
KV_FULL = 0.98  # an engine's KV-cache usage at which it takes no new request while another can


@dataclass(frozen=True)
class Dispatch:
    """How a replica set chooses: the policy's ``dispatch`` section, resolved."""

    balance: float = BALANCE
    slack: float = SLACK
    block_tokens: int = 16  # the engine's KV block, in tokens
    bytes_per_token: float = 4.0  # prompt bytes a token, for blocks without a tokenizer
    cache_tokens: int = 1 << 20  # tokens a replica's cache holds, until its engine says
    batch_max_load: float = 4.0  # a replica takes background work only under this load (and no queue)
    signals_ttl_s: float = 3.0  # an engine's figures older than this are unknown

    @property
    def block_bytes(self) -> int:
        """The index's block in prompt bytes: the engine's block, or MIN_BLOCK_BYTES where that is
        smaller (a long prompt then costs fewer hashes; placement needs no finer grain)."""
        return max(MIN_BLOCK_BYTES, round(self.block_tokens * self.bytes_per_token))

    @property
    def span(self) -> float:
        """Tokens in one of the index's blocks."""
        return self.block_bytes / self.bytes_per_token

    @property
    def cache_blocks(self) -> int:
        return max(1, int(self.cache_tokens // self.span))


@dataclass(eq=False)
class Placement:
    """One request's replica, and the prefill it was counted for there until its first token."""

    replica: ReplicaState
    prefill: float = 0.0
    started: bool = False


@dataclass
class ReplicaState:
    api_base: str
    api_key: str | None
    weight: int = 1
    outstanding: int = 0
    ejected_until: float = 0.0
    active_ok: bool = True  # the last active health check passed (or none ran yet)
    current_weight: int = field(default=0, repr=False)  # smooth weighted round-robin
    engine: EngineLoad | None = None  # what the engine last said of its load
    engine_at: float = float("-inf")  # when (the set's clock)
    outstanding_at_poll: int = 0  # this gateway's requests on it when the engine said so
    prefill: float = 0.0  # uncached prompt tokens this gateway sent there whose first token has not come

    def available(self, now: float) -> bool:
        return self.active_ok and now >= self.ejected_until


class ReplicaSet:
    def __init__(
        self,
        replicas: list[ReplicaState],
        strategy: Strategy | str,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
        dispatch: Dispatch | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        if strategy == "least_outstanding":  # the name before the engines' own load was read
            strategy = "least_load"
        self.replicas = replicas
        self.dispatch = dispatch or Dispatch()
        self.strategy: Strategy = strategy  # type: ignore[assignment]
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.index = PrefixIndex([self.dispatch.cache_blocks] * len(replicas))
        self.position = {r.api_base: i for i, r in enumerate(replicas)}
        self.shared: Callable[[int, tuple[int, ...]], None] | None = None  # told of every index addition
        self._ticket = 0  # the key of a request with neither a key nor blocks: ties then go round
        # the engines' figures as the view adds them to this gateway's counts, rebuilt when one changes
        # or goes stale (:meth:`_refresh`): the hot path then reads lists, not every replica's objects
        self._base = [0.0] * len(replicas)  # the engine's requests beyond this gateway's own at its poll
        self._waiting = [0.0] * len(replicas)
        self._full = [False] * len(replicas)
        self._fresh_until = float("-inf")
        self._weighted = any(r.weight != 1 for r in replicas)
        # the prefix index matters only where there is a choice to make
        self.indexed = self.strategy == "prefix" and len(replicas) > 1

    def any_available(self) -> bool:
        now = self.clock()
        return any(r.available(now) for r in self.replicas)

    # -- what the engines said -------------------------------------------------------------
    def observe(self, replica: ReplicaState, load: EngineLoad | None) -> None:
        """The engine's answer to a poll (None: it gave none; its figures are unknown from now)."""
        self._fresh_until = float("-inf")  # the view's figures are rebuilt at the next choice
        if load is None:
            replica.engine, replica.engine_at = None, float("-inf")
            return
        replica.engine, replica.engine_at = load, self.clock()
        replica.outstanding_at_poll = replica.outstanding
        if load.blocks and load.block_size:  # the engine's cache, in the index's blocks
            blocks = int(load.blocks * load.block_size // self.dispatch.span)
            self.index.resize(self.position[replica.api_base], blocks)

    def known(self, replica: ReplicaState, now: float | None = None) -> bool:
        """The engine's figures are fresh enough to count."""
        now = self.clock() if now is None else now
        return replica.engine is not None and now - replica.engine_at <= self.dispatch.signals_ttl_s

    def load(self, replica: ReplicaState, now: float) -> float:
        """Requests on ``replica`` per unit of weight: the engine's running and waiting at its last
        answer, plus what this gateway sent since and minus what of its own ended since (never
        under this gateway's own count); this gateway's own count where the engine says nothing."""
        if now > self._fresh_until:
            self._refresh(now)
        return (replica.outstanding + self._base[self.position[replica.api_base]]) / replica.weight

    # -- the choice ------------------------------------------------------------------------
    def view(self, now: float, ok: list[bool], background: bool = False) -> View:
        """The pool as the rule sees it (the hot path): each replica's :meth:`load` (this gateway's
        count plus the engine's others, kept as lists between polls), whether its KV cache is
        full, and (for ``background`` work) whether it has spare room: under ``batch_max_load``,
        and no request waiting in its engine where the engine says."""
        if now > self._fresh_until:
            self._refresh(now)
        reps = self.replicas
        if self._weighted:
            load = [(r.outstanding + b) / r.weight for r, b in zip(reps, self._base, strict=True)]
        else:
            load = [r.outstanding + b for r, b in zip(reps, self._base, strict=True)]
        spare = self._full  # read only for background work: then computed here
        if background:
            cap = self.dispatch.batch_max_load
            spare = [x < cap and w == 0 for x, w in zip(load, self._waiting, strict=True)]
        return View(load, ok, self._full, spare, [r.prefill for r in reps])

    def _refresh(self, now: float) -> None:
        """The engines' figures that are fresh, as lists; the moment the first of them goes stale."""
        ttl, until = self.dispatch.signals_ttl_s, float("inf")
        for i, r in enumerate(self.replicas):
            e = r.engine
            if e is not None and now - r.engine_at <= ttl:
                self._base[i] = max(0.0, e.queue - r.outstanding_at_poll)
                self._waiting[i] = e.waiting
                self._full[i] = e.kv_usage is not None and e.kv_usage >= KV_FULL
                until = min(until, r.engine_at + ttl)
            else:
                self._base[i], self._waiting[i], self._full[i] = 0.0, 0.0, False
        self._fresh_until = until

    def pick(
        self, tried: set[str], affinity: str | None = None, *, text: str = "", background: bool = False
    ) -> ReplicaState | None:
        """:meth:`place`'s replica, for a caller that does not say when the first token came."""
        placed = self.place(tried, affinity, text=text, background=background)
        if placed is None:
            return None
        self.started(placed)
        return placed.replica

    def started(self, placed: Placement) -> None:
        """The placed request's first token came (or it ended without one): its prefill is done."""
        if not placed.started:
            placed.started = True
            placed.replica.prefill = max(0.0, placed.replica.prefill - placed.prefill)

    def place(
        self, tried: set[str], affinity: str | None = None, *, text: str = "", background: bool = False
    ) -> Placement | None:
        """The next replica to try: untried and available ones first, then untried, then any.

        ``text``: the prompt (for the ``prefix`` rule's blocks); ``affinity``: the request's own
        key (a session, a batch group): the rendezvous key its ties are broken by, and, under
        ``round_robin``, the replica itself (the batch-only affinity of old). ``background`` (a
        batch line): only an available replica with spare room; None when there is none now."""
        reps = self.replicas
        if len(reps) == 1 and not background:  # nothing to choose: no rule, no index
            return Placement(reps[0])
        now = self.clock()
        avail = [r.active_ok and now >= r.ejected_until for r in reps]  # ReplicaState.available, inlined
        ok = [a and r.api_base not in tried for a, r in zip(avail, reps, strict=True)] if tried else avail
        if not any(ok):
            ok = [r.api_base not in tried for r in reps]  # none known good: untried, then any
            if not any(ok):
                ok = [True] * len(reps)
        key = key_of(affinity) if affinity is not None else 0
        if self.strategy == "round_robin":
            cand = [i for i, x in enumerate(ok) if x]
            if background and not any(self.view(now, ok, True).spare[i] for i in cand):
                return None
            if affinity is not None:
                return Placement(reps[max(cand, key=lambda i: rank(key, i))])
            return Placement(self._smooth_weighted([reps[i] for i in cand]))
        d = self.dispatch
        data = text.encode("utf-8", "surrogatepass") if self.indexed and text else b""
        hashes = index_hashes(data, d.block_bytes) if data else ()
        size = len(data) / d.bytes_per_token if hashes else 0.0
        if not key:  # the whole prompt (the same prompt, the same tie in every gateway), else a ticket
            if hashes:  # the CRC of the whole prompt: the blocks' chain continued over the rest
                tail = memoryview(data)[covered(len(hashes), d.block_bytes) :]
                key = (len(data) << 32) | zlib.crc32(tail, hashes[-1] & 0xFFFFFFFF)
            else:
                self._ticket += 1
                key = self._ticket
        got = choose(
            self.view(now, ok, background),
            strategy=self.strategy,
            index=self.index,
            hashes=hashes,
            key=key,
            balance=d.balance,
            slack=d.slack,
            background=background,
            block_bytes=d.block_bytes,
            per_token=d.bytes_per_token,
        )
        if got is None:
            return None
        i, depth = got
        placed = Placement(reps[i])
        if hashes:
            self.index.add(i, hashes)
            if self.shared is not None:
                self.shared(i, hashes)
            placed.prefill = max(0.0, size - covered(depth, d.block_bytes) / d.bytes_per_token)
            reps[i].prefill += placed.prefill
        return placed

    def extend(self, replica: ReplicaState, text: str) -> None:
        """``replica`` now also holds ``text`` (a prompt and its answer, as the conversation's next
        turn will start): the engine caches what it generated, so the next turn's blocks lead there."""
        if not self.indexed or not text:
            return
        hashes = index_hashes(text, self.dispatch.block_bytes)
        if hashes:
            i = self.position[replica.api_base]
            self.index.add(i, hashes)
            if self.shared is not None:
                self.shared(i, hashes)

    def _smooth_weighted(self, candidates: list[ReplicaState]) -> ReplicaState:
        # nginx's smooth weighted round-robin: even spread, weights respected.
        total = 0
        best = candidates[0]
        for r in candidates:
            r.current_weight += r.weight
            total += r.weight
            if r.current_weight > best.current_weight:
                best = r
        best.current_weight -= total
        return best

    def eject(self, replica: ReplicaState, for_s: float | None = None) -> None:
        """Out for ``cooldown_s``, or what the replica asked (a 429's ``retry-after``) if longer."""
        replica.ejected_until = self.clock() + max(self.cooldown_s, for_s or 0.0)

    def restore(self, replica: ReplicaState) -> None:
        replica.ejected_until = 0.0
