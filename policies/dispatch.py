"""The dispatch rule: which replica of a pool takes a request, by its load and by what its prefix
cache holds. One pure function, :func:`choose`, used by the gateway's remote backends, the Batch
API (through them) and the fleet simulator (``benchmarks/fleet_sim.py``) alike.

What the rule sees of each replica (:class:`Seen`, or a :class:`View`, its columns): whether it is
up, its load (requests running and waiting in the engine, as the engine's own counters said at
the last poll plus what this gateway sent since; the gateway's own count where the engine says
nothing), whether its KV cache is full, whether it has room for background work (a Batch API
line), and the prefill this gateway queued there.

What it knows of the caches is a :class:`PrefixIndex`: for each replica, the block hashes of the
prompts it was given (or, where the engine publishes its KV-cache events, the blocks it holds),
aged out least recently used first at the replica's cache capacity. A prompt's blocks are runs
of its UTF-8 bytes (:func:`index_hashes`: fixed, then doubling every few blocks), each hash
covering everything before it, as an engine's block hashes do: two prompts share block k only if
they share their first k blocks.

The rule (``strategy: prefix``), consistent hashing with bounded loads, then the prefill ahead:

1. **Eligible**: the replicas that are up, whose KV cache is not full, and whose load is within
   the bound: at most ``slack`` above the least loaded replica's, or at most ``balance`` times the
   mean once this request is counted. A hot prefix cannot pile onto one replica: past the bound,
   its requests go elsewhere (which then caches it too).
2. **Prefill ahead**: among the eligible, the replica where the prompt's first token should come
   soonest, as the prompt tokens to prefill there before it: what this gateway sent there whose
   first token has not come (``Seen.prefill``), plus the part of this prompt its cache does not
   hold (by the index). A replica holding the prefix wins unless it is buried in other prefills;
   among replicas that hold nothing, the one with the least prefill queued. Counting running
   requests instead (least load) herds new prompts onto the replica whose requests just ended,
   and their prefills then share its steps (measured by the simulator: docs/fleet.md).
3. **Ties** (equal cost: often, when nothing is queued) go by the request's key (the session or
   batch group, else the whole prompt's hash): the same prompt gets the same replica in every
   gateway that sees the same figures; different prompts spread evenly.

``strategy: least_load`` is step 1 and the least loaded of the eligible, ties by the key. A
background call (a batch line) may only go to a replica with ``spare`` room; when none has,
:func:`choose` returns None and the caller waits: online requests go first.

No I/O, no clock: the caller gives the loads and owns the index.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Strategy = Literal["round_robin", "least_load", "prefix"]

BALANCE = 1.25  # the default bound on a replica's load against the mean (python -m benchmarks fleet-sim --sweep)
SLACK = 8.0  # requests above the least loaded replica that are always within the bound (the same sweep)
MAX_BLOCKS = 512  # a prompt's blocks hashed at most (its first MAX_BLOCKS * block_bytes bytes)


@dataclass(frozen=True, slots=True)
class Seen:
    """One replica as the rule sees it."""

    up: bool = True
    load: float = 0.0  # requests on it (running and waiting), per unit of weight
    full: bool = False  # its KV cache is full: a new request would wait or preempt another
    spare: bool = True  # it may take background work now (its queue is under the batch threshold)
    prefill: float = 0.0  # prompt tokens sent to it whose first token has not come (uncached part)


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


GROW = 8  # the index's blocks of one size before the size doubles


def index_hashes(text: str | bytes, block_bytes: int, limit: int = MAX_BLOCKS) -> tuple[int, ...]:
    """The prefix index's blocks of ``text``: as :func:`block_hashes`, but the block size doubles
    every :data:`GROW` blocks (8 of ``block_bytes``, 8 of twice that, ...): a long prompt costs a
    few dozen hashes, not hundreds, and the first blocks, where prompts part, stay fine-grained.
    Block k ends at byte :func:`covered` (k, block_bytes)."""
    if block_bytes < 1:
        raise ValueError("block_bytes must be at least 1")
    data = memoryview(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    end, crc = len(data), zlib.crc32
    out: list[int] = []
    h = start = k = 0
    size = block_bytes
    while True:
        stop = start + size
        for _ in range(GROW):
            if stop > end or k >= limit:
                return tuple(out)
            h = crc(data[start:stop], h)
            k += 1
            out.append((k << 32) | h)
            start, stop = stop, stop + size
        size *= 2


def covered(depth: int, block_bytes: int) -> int:
    """Bytes the first ``depth`` blocks of :func:`index_hashes` cover."""
    groups, rest = divmod(depth, GROW)
    return block_bytes * (GROW * ((1 << groups) - 1) + rest * (1 << groups))


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

    def depths(self, hashes: Iterable[int], among: int) -> dict[int, int]:
        """Each replica of the bit mask ``among`` holding the prompt's first block, with the length
        of the run of ``hashes`` it holds from there."""
        out: dict[int, int] = {}
        depth, alive = 0, among
        holders = self._holders
        for h in hashes:
            nxt = alive & holders.get(h, 0)
            gone = alive & ~nxt
            if gone and depth:
                _bits(gone, depth, out)
            if not nxt:
                return out
            depth += 1
            alive = nxt
        if depth:
            _bits(alive, depth, out)
        return out

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


def _bits(mask: int, depth: int, out: dict[int, int]) -> None:
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = depth
        mask ^= low


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
    prefill: list[float] | None = None  # prompt tokens sent there whose first token has not come

    @classmethod
    def of(cls, replicas: Sequence[Seen]) -> View:
        return cls(
            [r.load for r in replicas],
            [r.up for r in replicas],
            [r.full for r in replicas],
            [r.spare for r in replicas],
            [r.prefill for r in replicas],
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
    block_bytes: int = 1,
    per_token: float = 1.0,
) -> tuple[int, int] | None:
    """(replica, blocks matched) for one request, or None when no replica may take it (none is
    up; for a ``background`` call, none has spare room). ``key``: the request's rendezvous key
    (default: its last block's hash). ``hashes``: the prompt's :func:`index_hashes` of
    ``block_bytes``; ``per_token``: bytes a token (a match saves the tokens of its blocks).
    ``strategy`` ``round_robin`` is stateful and lives with the replica set; here it is treated
    as ``least_load``."""
    v = view if isinstance(view, View) else View.of(view)
    pool = eligible(v, balance=balance, slack=slack, background=background)
    if not pool:
        return None
    if not key and hashes:
        key = hashes[-1]
    if strategy == "prefix" and hashes:
        return _by_prefill(v, pool, index, hashes, key, block_bytes, per_token)
    load = v.load
    least = min([load[i] for i in pool])
    return tie([i for i in pool if load[i] == least], key), 0


def tie(ties: list[int], key: int) -> int:
    """One of ``ties`` (replica positions, in order) by the request's key: the same key, the same
    one, in every gateway. The keys' low bits are a CRC (a prompt's, a session's) or a counter (a
    request with neither: then ties go round in turn)."""
    return ties[key % len(ties)] if len(ties) > 1 else ties[0]


def _by_prefill(
    v: View,
    pool: list[int],
    index: PrefixIndex | None,
    hashes: Sequence[int],
    key: int,
    block_bytes: int,
    per_token: float,
) -> tuple[int, int]:
    """Steps 2 and 3 of the rule: the replica where the prompt's first token comes soonest, as the
    prefill ahead of it: what this gateway sent there and is not yet started, plus the part of
    this prompt its cache does not hold. Ties (every replica the same) by the key."""
    among = 0
    for i in pool:
        among |= 1 << i
    depths = index.depths(hashes, among) if index is not None else {}
    costs = list(v.prefill) if v.prefill else [0.0] * len(v.load)  # the prefill ahead; + size for all
    saved: dict[int, float] = {}
    for i, d in depths.items():
        if d not in saved:
            saved[d] = covered(d, block_bytes) / per_token
        costs[i] -= saved[d]
    best = min([costs[i] for i in pool])
    chosen = tie([i for i in pool if costs[i] == best], key)
    return chosen, depths.get(chosen, 0)
