"""The dispatch rule: which replica of a pool takes a request, by its load and by what its prefix
cache holds. One pure function, :func:`choose`, used by the gateway's remote backends, the Batch
API (through them) and the fleet simulator (``benchmarks/fleet_sim.py``) alike.

What the rule sees of each replica (:class:`Seen`): whether it is up, its load (requests running
and waiting in the engine, as the engine's own counters said at the last poll plus what this
gateway sent since; the gateway's own count where the engine says nothing), whether its KV cache
is full, and whether it has room for background work (a Batch API line).

What it knows of the caches is a :class:`PrefixIndex`: for each replica, the block hashes of the
prompts it was given (or, where the engine publishes its KV-cache events, the blocks it holds),
aged out least recently used first at the replica's cache capacity. A prompt's blocks are fixed
runs of its UTF-8 bytes (:func:`block_hashes`), each hash covering everything before it, as an
engine's block hashes do: two prompts share block k only if they share their first k blocks.

The rule (``strategy: prefix``), consistent hashing with bounded loads plus the cache:

1. **Eligible**: the replicas that are up, whose KV cache is not full, and whose load is within
   the bound: at most ``slack`` above the least loaded replica's, or at most ``balance`` times the
   mean once this request is counted. A hot prefix cannot pile onto one replica: past the bound,
   its requests go elsewhere (which then caches it too).
2. **Cache**: among the eligible, those holding the longest run of the prompt's blocks.
3. **Load**: among those (all eligible when none holds a block), the least loaded; a tie goes to
   the replica the request's key ranks first (rendezvous hashing on the key: the session, the
   batch group, or the prompt's first block), so gateways that see the same loads agree.

``strategy: least_load`` is steps 1 (without the cache) and 3. A background call (a batch line)
may only go to a replica with ``spare`` room; when none has, :func:`choose` returns None and the
caller waits: online requests go first.

No I/O, no clock: the caller gives the loads and owns the index.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Strategy = Literal["round_robin", "least_load", "prefix"]
STRATEGIES: tuple[str, ...] = ("round_robin", "least_load", "prefix")

BALANCE = 1.5  # the default bound on a replica's load against the mean (benchmarks/fleet_sim.py measures it)
SLACK = 2.0  # requests above the least loaded replica that are always within the bound
MAX_BLOCKS = 512  # a prompt's blocks hashed at most (its first MAX_BLOCKS * block_bytes bytes)


@dataclass(frozen=True, slots=True)
class Seen:
    """One replica as the rule sees it."""

    up: bool = True
    load: float = 0.0  # requests on it (running and waiting), per unit of weight
    full: bool = False  # its KV cache is full: a new request would wait or preempt another
    spare: bool = True  # it may take background work now (its queue is under the batch threshold)


def block_hashes(text: str, block_bytes: int, limit: int = MAX_BLOCKS) -> tuple[int, ...]:
    """The chained hashes of ``text``'s whole blocks of ``block_bytes`` UTF-8 bytes: hash k covers
    bytes [0, k * block_bytes). The CRC-32 of the prefix, with the block's number in the high
    bits (two prefixes collide only at the same depth). A text shorter than a block has none."""
    if block_bytes < 1:
        raise ValueError("block_bytes must be at least 1")
    data = memoryview(text.encode("utf-8", "surrogatepass"))
    n = min(len(data) // block_bytes, limit)
    out: list[int] = []
    h = 0
    for k in range(n):
        h = zlib.crc32(data[k * block_bytes : (k + 1) * block_bytes], h)
        out.append(((k + 1) << 32) | h)
    return tuple(out)


class PrefixIndex:
    """Which blocks each replica's prefix cache holds, as far as the gateway knows.

    ``holders`` maps a block hash to a bit mask of the replicas holding it, so the longest match
    over every replica costs one dict lookup per block of the prompt, whatever the replica count.
    Each replica's blocks are also kept least recently used first, and the oldest dropped past its
    ``capacity`` (in blocks), as the engine evicts them."""

    def __init__(self, capacity: Sequence[int]) -> None:
        if not capacity or any(c < 1 for c in capacity):
            raise ValueError("every replica needs a capacity of at least one block")
        self.capacity = list(capacity)
        self._holders: dict[int, int] = {}
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in capacity]

    def __len__(self) -> int:
        return len(self._holders)

    def held(self, replica: int) -> int:
        """Blocks the index holds for ``replica``."""
        return len(self._lru[replica])

    def match(self, hashes: Iterable[int], among: int) -> tuple[int, int]:
        """(depth, mask): the longest run of ``hashes`` from the first that a replica in the bit
        mask ``among`` holds, and the replicas holding all of it; (0, 0) when none holds the first."""
        depth, alive = 0, among
        holders = self._holders
        for h in hashes:
            nxt = alive & holders.get(h, 0)
            if not nxt:
                break
            depth += 1
            alive = nxt
        return (depth, alive) if depth else (0, 0)

    def add(self, replica: int, hashes: Sequence[int]) -> None:
        """``replica`` now holds ``hashes`` (a prompt it was given, or blocks its engine stored).
        The deepest are touched first, so the shallow blocks many prompts share are evicted last."""
        bit = 1 << replica
        lru = self._lru[replica]
        holders = self._holders
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) | bit
        cap = self.capacity[replica]
        while len(lru) > cap:
            self._forget(replica, lru.popitem(last=False)[0])

    def remove(self, replica: int, hashes: Iterable[int]) -> None:
        """``replica`` no longer holds ``hashes`` (its engine evicted them)."""
        lru = self._lru[replica]
        for h in hashes:
            if lru.pop(h, 0) is None:
                self._forget(replica, h)

    def clear(self, replica: int) -> None:
        """``replica`` holds nothing (restarted, or its engine cleared its cache)."""
        for h in self._lru[replica]:
            self._forget(replica, h)
        self._lru[replica].clear()

    def resize(self, replica: int, capacity: int) -> None:
        """The engine said how many blocks its cache holds."""
        self.capacity[replica] = max(1, capacity)
        self.add(replica, ())

    def _forget(self, replica: int, h: int) -> None:
        mask = self._holders.get(h, 0) & ~(1 << replica)
        if mask:
            self._holders[h] = mask
        else:
            self._holders.pop(h, None)


def rank(key: int, replica: int) -> int:
    """Rendezvous hashing's weight of ``replica`` for ``key``: the highest takes the key. A
    64-bit mix (splitmix64's finaliser) of the two: cheap, and the same in every process."""
    z = (key * 0x9E3779B97F4A7C15 + (replica + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def key_of(text: str) -> int:
    """A request's rendezvous key from a string (a session id, a batch group's key)."""
    data = text.encode("utf-8", "surrogatepass")
    return (zlib.crc32(data) << 32) | zlib.adler32(data)


@dataclass(slots=True)
class View:
    """The pool as the rule sees it, a column per figure (position: the replica): what
    :func:`choose` reads. :meth:`of` makes one from :class:`Seen` rows."""

    load: list[float]
    up: list[bool]
    full: list[bool]
    spare: list[bool]

    @classmethod
    def of(cls, replicas: Sequence[Seen]) -> View:
        return cls(
            [r.load for r in replicas],
            [r.up for r in replicas],
            [r.full for r in replicas],
            [r.spare for r in replicas],
        )


def eligible(view: View | Sequence[Seen], *, balance: float, slack: float, background: bool = False) -> list[int]:
    """Step 1 of the rule: the replicas within the load bound (see the module's docstring)."""
    v = view if isinstance(view, View) else View.of(view)
    load = v.load
    up = [i for i, ok in enumerate(v.up) if ok]
    if background:
        up = [i for i in up if v.spare[i]]
    if not up:
        return []
    full = v.full
    roomy = [i for i in up if not full[i]] or up
    least = min([load[i] for i in roomy])
    bound = max(least + slack, balance * (sum([load[i] for i in up]) + 1) / len(up) - 1)
    return [i for i in roomy if load[i] <= bound]


def choose(
    view: View | Sequence[Seen],
    *,
    strategy: Strategy = "prefix",
    index: PrefixIndex | None = None,
    hashes: Sequence[int] = (),
    key: int = 0,
    balance: float = BALANCE,
    slack: float = SLACK,
    background: bool = False,
) -> tuple[int, int] | None:
    """(replica, blocks matched) for one request, or None when no replica may take it (none is
    up; for a ``background`` call, none has spare room). ``key``: the request's rendezvous key
    (default: its first block's hash). ``strategy`` ``round_robin`` is stateful and lives with the
    replica set; here it is treated as ``least_load``."""
    v = view if isinstance(view, View) else View.of(view)
    pool = eligible(v, balance=balance, slack=slack, background=background)
    if not pool:
        return None
    depth = 0
    if strategy == "prefix" and index is not None and hashes:
        among = 0
        for i in pool:
            among |= 1 << i
        depth, mask = index.match(hashes, among)
        if depth:
            pool = [i for i in pool if mask >> i & 1]
    if not key and hashes:
        key = hashes[0]
    load = v.load
    least = min([load[i] for i in pool])
    ties = [i for i in pool if load[i] == least]
    if len(ties) == 1:
        return ties[0], depth
    return max(ties, key=lambda i: rank(key, i)), depth
