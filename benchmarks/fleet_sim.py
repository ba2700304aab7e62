"""A discrete-event simulator of a fleet of inference engines behind the gateway's dispatch rule
(``python -m benchmarks fleet-sim``; docs/fleet.md, "Dispatch: the fleet simulator").

Each replica is a model of one vLLM engine: continuous batching over a FCFS waiting queue, KV
blocks of ``block_tokens``, chunked prefill under a token budget per step (vLLM's
``max_num_batched_tokens``) beside one decode token for every running request, and a prefix
cache: the blocks of finished requests stay, least recently used evicted first, until a new
request needs the room; a prompt's cached whole blocks are not prefilled again. A step costs
``t_step + prefill tokens * t_prefill + decoding requests * t_decode + context tokens read *
t_ctx + requests admitted * t_request`` (constants per :class:`Profile`, derived in the docs).

Simplifications (said again in the docs): a request reserves the blocks of its prompt and its
whole output when admitted (no preemption); a block counts as cached from its request's
admission; tokens are UTF-8 bytes / 4 of real text.

The dispatch rule is the gateway's own (``backends/replicas.py``'s :class:`ReplicaSet`, driven by
the rules of ``benchmarks/fleet_rules.py``), with the engines' load polled every ``poll_s``. Pure
Python, one heapq event loop; deterministic for a seed.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.fleet_rules import Rule


@dataclass(frozen=True)
class Profile:
    """One engine's costs and limits (docs/fleet.md says where each number comes from)."""

    name: str
    t_step: float  # s: a step's fixed cost (the weights read once)
    t_prefill: float  # s per prompt token prefilled
    t_decode: float  # s per request decoding in the step
    t_ctx: float  # s per context token read by the decoding requests (their KV)
    t_request: float  # s per request admitted (the serving stack's own cost per request)
    block_tokens: int
    kv_tokens: int  # the KV cache: what a replica's running requests and its prefix cache share
    max_batched: int  # vLLM's max_num_batched_tokens
    max_seqs: int  # vLLM's max_num_seqs


PROFILES: dict[str, Profile] = {
    # Llama-3.1-8B-Instruct, BF16, one H100-80GB, vLLM V1 defaults on a >= 70 GiB GPU (8192 / 1024)
    "h100-llama8b": Profile("h100-llama8b", 6.0e-3, 35e-6, 0.12e-3, 39e-9, 0.0, 16, 400_000, 8192, 1024),
    # SmolLM2-135M on vLLM's CPU build, one core (docs/benchmarks.md), in this simulator's tokens
    "cpu-smollm2": Profile("cpu-smollm2", 2.0e-3, 0.776e-3, 4.0e-3, 0.0, 55e-3, 32, 3072, 2048, 16),
}


@dataclass(slots=True, eq=False)
class Request:
    rid: int
    text: str
    prompt: int  # tokens: ceil(UTF-8 bytes / 4)
    output: int  # tokens to generate
    hashes: tuple[int, ...]  # the prompt's whole blocks (policies.dispatch.block_hashes)
    extra: tuple[int, ...] = ()  # blocks of prompt + answer past the prompt's, cached when it ends
    affinity: str | None = None
    background: bool = False
    then: Request | None = None  # the conversation's next turn, sent ``think`` s after this ends
    think: float = 0.0
    answer: str = ""  # its answer's text, where a next turn continues it (the gateway indexes it)
    arrival: float = 0.0
    replica: int = -1
    cached: int = 0  # prompt tokens found in the replica's prefix cache
    todo: int = 0  # prompt tokens left to prefill
    blocks: int = 0  # blocks reserved past the prompt's whole blocks
    first: float = -1.0  # when its first token was produced
    done: float = -1.0


class Engine:
    """One replica's scheduler, KV blocks and prefix cache."""

    def __init__(self, idx: int, profile: Profile, sim: Sim) -> None:
        self.idx, self.p, self.sim = idx, profile, sim
        self.bit = 1 << idx
        self.cap = max(1, profile.kv_tokens // profile.block_tokens)
        self.refs: dict[int, int] = {}  # shared prompt blocks in use: hash -> requests using it
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached blocks no request uses, oldest first
        self.private = 0  # blocks in use that no other request can share
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[tuple[int, int, Request]] = []  # (step it ends at, rid, request)
        self.n_decode = 0
        self.ctx = 0
        self.stepno = 0
        self.busy = False
        self.chunks: list[tuple[Request, int]] = []

    @property
    def running(self) -> int:
        return len(self.prefilling) + self.n_decode

    def kv_usage(self) -> float:
        return min(1.0, (len(self.refs) + self.private) / self.cap)

    def holds(self, h: int) -> bool:
        return h in self.refs or h in self.lru

    # -- KV blocks ---------------------------------------------------------------------------
    def admit(self, q: Request) -> bool:
        """Take ``q`` from the queue if its blocks fit (or nothing runs), as vLLM's scheduler does."""
        refs, lru = self.refs, self.lru
        if self.running >= self.p.max_seqs:
            return False
        bt = self.p.block_tokens
        total = max(len(q.hashes), math.ceil((q.prompt + q.output) / bt))
        new = sum(1 for h in q.hashes if h not in refs)
        if self.running and len(refs) + self.private + new + total - len(q.hashes) > self.cap:
            return False
        depth = 0
        for h in q.hashes:
            if h not in refs and h not in lru:
                break
            depth += 1
        for h in q.hashes:
            if h in refs:
                refs[h] += 1
            else:
                if lru.pop(h, 0) is not None:
                    self.sim.hold(self.bit, h)
                refs[h] = 1
        q.blocks = total - len(q.hashes)
        self.private += q.blocks
        self._evict()
        q.cached = min(depth * bt, q.prompt - 1)
        q.todo = q.prompt - q.cached
        return True

    def release(self, q: Request) -> None:
        """``q`` ended: its prompt's blocks (and its answer's) join the cache, deepest first."""
        refs, lru = self.refs, self.lru
        for h in reversed(q.hashes):
            n = refs[h] - 1
            if n:
                refs[h] = n
            else:
                del refs[h]
                lru[h] = None
        self.private -= q.blocks
        for h in q.extra:
            if h not in refs and h not in lru:
                lru[h] = None
                self.sim.hold(self.bit, h)
        self._evict()

    def _evict(self) -> None:
        lru = self.lru
        over = len(self.refs) + self.private + len(lru) - self.cap
        while over > 0 and lru:
            self.sim.drop(self.bit, lru.popitem(last=False)[0])
            over -= 1

    # -- steps -------------------------------------------------------------------------------
    def start_step(self) -> None:
        p, now = self.p, self.sim.now
        budget = p.max_batched - self.n_decode
        chunks: list[tuple[Request, int]] = []
        for q in self.prefilling:
            if budget <= 0:
                break
            c = min(q.todo, budget)
            chunks.append((q, c))
            budget -= c
        admitted = 0
        while self.waiting and budget > 0 and self.admit(self.waiting[0]):
            q = self.waiting.popleft()
            self.sim.stats.admitted(q)
            admitted += 1
            self.prefilling.append(q)
            c = min(q.todo, budget)
            chunks.append((q, c))
            budget -= c
        if not chunks and not self.n_decode:
            self.busy = False
            return
        tokens = sum(c for _, c in chunks)
        dt = p.t_step + tokens * p.t_prefill + self.n_decode * p.t_decode + self.ctx * p.t_ctx
        self.busy, self.chunks = True, chunks
        self.sim.at(now + dt + admitted * p.t_request, self.end_step)

    def end_step(self) -> None:
        self.stepno += 1
        self.ctx += self.n_decode
        dec = self.decoding
        while dec and dec[0][0] <= self.stepno:
            q = heapq.heappop(dec)[2]
            self.n_decode -= 1
            self.ctx -= q.prompt + q.output
            self._end(q)
        now = self.sim.now
        for q, c in self.chunks:
            q.todo -= c
            if q.todo:
                continue
            self.prefilling.remove(q)
            q.first = now
            first = getattr(self.sim.rule, "first", None)
            if first is not None:  # the gateway's rule counts a replica's prefill until the first token
                first(q.replica, q)
            if q.output <= 1:
                self._end(q)
            else:
                heapq.heappush(dec, (self.stepno + q.output - 1, q.rid, q))
                self.n_decode += 1
                self.ctx += q.prompt + 1
        self.chunks = []
        self.start_step()
        self.sim.step_ended()

    def _end(self, q: Request) -> None:
        q.done = self.sim.now
        self.release(q)
        self.sim.finished(q)


@dataclass
class Stats:
    """What a run measures."""

    replicas: int
    ttft: list[float] = field(default_factory=list)
    batch_ttft: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    output: int = 0
    load_sum: list[float] = field(default_factory=list)
    first_arrival: float = math.inf
    last_done: float = 0.0
    batch_done: float = 0.0
    done: int = 0

    def admitted(self, q: Request) -> None:
        self.prompt += q.prompt
        self.cached += q.cached

    def ended(self, q: Request) -> None:
        self.done += 1
        self.output += q.output
        (self.batch_ttft if q.background else self.ttft).append(q.first - q.arrival)
        self.last_done = max(self.last_done, q.done)
        if q.background:
            self.batch_done = max(self.batch_done, q.done)


class Sim:
    """The event loop, the engines, and the dispatch rule's calls."""

    def __init__(self, profile: Profile, replicas: int, poll_s: float = 0.25, retry_s: float = 0.01) -> None:
        self.now = 0.0
        self.profile = profile
        self.poll_s, self.retry_s = poll_s, retry_s
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.holders: dict[int, int] = {}  # block hash -> bit mask of the engines holding it
        self.engines = [Engine(i, profile, self) for i in range(replicas)]
        self.stats = Stats(replicas, load_sum=[0.0] * replicas)
        self.rule: Rule | None = None
        self.backlog: deque[Request] = deque()
        self.next_retry = 0.0
        self.closed: deque[Request] | None = None  # closed loop: the requests not sent yet
        self.expected = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn))

    def hold(self, bit: int, h: int) -> None:
        self.holders[h] = self.holders.get(h, 0) | bit

    def drop(self, bit: int, h: int) -> None:
        m = self.holders.get(h, 0) & ~bit
        if m:
            self.holders[h] = m
        else:
            self.holders.pop(h, None)

    # -- requests ----------------------------------------------------------------------------
    def arrive(self, q: Request) -> None:
        q.arrival = self.now
        self.stats.first_arrival = min(self.stats.first_arrival, self.now)
        assert self.rule is not None
        i = self.rule.pick(q)
        if i is None:
            self.backlog.append(q)
            return
        self.send(i, q)

    def send(self, i: int, q: Request) -> None:
        assert self.rule is not None
        q.replica = i
        self.rule.sent(i, q)
        e = self.engines[i]
        e.waiting.append(q)
        if not e.busy:
            e.start_step()

    def finished(self, q: Request) -> None:
        assert self.rule is not None
        self.rule.ended(q.replica, q)
        self.stats.ended(q)
        if q.then is not None:
            nxt = q.then
            self.at(self.now + q.think, lambda: self.arrive(nxt))
        elif self.closed:
            self.arrive(self.closed.popleft())

    def step_ended(self) -> None:
        if self.backlog and self.now >= self.next_retry:
            self.next_retry = self.now + self.retry_s
            assert self.rule is not None
            while self.backlog:
                q = self.backlog[0]
                i = self.rule.pick(q)
                if i is None:
                    break
                self.backlog.popleft()
                self.send(i, q)

    def poll(self) -> None:
        assert self.rule is not None
        self.rule.poll(self.engines)
        for i, e in enumerate(self.engines):
            self.stats.load_sum[i] += e.running + len(e.waiting)
        if self.stats.done < self.expected:
            self.at(self.now + self.poll_s, self.poll)
        if self.backlog and not any(e.busy for e in self.engines):
            self.step_ended()  # an idle fleet retries its backlog at each poll

    def run(self, rule: Rule, timed: list[tuple[float, Request]], expected: int, closed: int = 0) -> Stats:
        """Send ``timed`` (arrival time, request), or with ``closed`` that many at once and the next
        as each ends; run until ``expected`` requests have ended."""
        self.rule, self.expected = rule, expected
        rule.attach(self)
        if closed:
            self.closed = deque(q for _, q in timed)
            for _ in range(min(closed, len(self.closed))):
                q = self.closed.popleft()
                self.at(0.0, lambda q=q: self.arrive(q))  # type: ignore[misc]
        else:
            for t, q in timed:
                self.at(t, lambda q=q: self.arrive(q))  # type: ignore[misc]
        self.at(0.0, self.poll)
        events = self.events
        while events and self.stats.done < expected:
            t, _, fn = heapq.heappop(events)
            self.now = t
            fn()
        return self.stats


def oracle_hit_rate(requests: list[Request], capacity_blocks: int, block_tokens: int) -> float:
    """The hit rate of one shared LRU cache of ``capacity_blocks`` (the fleet's total) fed every
    request in arrival order: what a single cache of the whole fleet's size would reach."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for q in requests:
        depth = 0
        for h in q.hashes:
            if h not in lru:
                break
            depth += 1
        hit += min(depth * block_tokens, q.prompt - 1)
        total += q.prompt
        for h in reversed((*q.hashes, *q.extra)):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit / max(1, total)


def summary(stats: Stats, poll_s: float) -> dict[str, Any]:
    """A run's figures: throughput, TTFT, hit rate, the busiest replica's load against the mean."""
    ttft = sorted(stats.ttft)
    span = max(1e-9, stats.last_done - stats.first_arrival)
    loads = stats.load_sum
    mean = sum(loads) / max(1, len(loads))
    return {
        "requests": stats.done,
        "throughput_tok_s": stats.output / span,
        "ttft_p50_s": pct(ttft, 0.50),
        "ttft_p99_s": pct(ttft, 0.99),
        "hit_rate": stats.cached / max(1, stats.prompt),
        "busiest_over_mean": (max(loads) / mean) if mean else 1.0,
        "mean_load": mean * poll_s / span,
        "span_s": span,
        "batch_done_s": stats.batch_done,
        "batch_ttft_p50_s": pct(sorted(stats.batch_ttft), 0.5),
    }


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``xs`` (nearest rank); 0 for none."""
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]
