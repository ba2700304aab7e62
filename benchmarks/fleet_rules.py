"""The dispatch rules the fleet simulator compares (``benchmarks/fleet_sim.py``).

- ``round_robin``, ``least_load``, ``prefix``: the gateway's own, through ``backends/replicas.py``'s
  :class:`ReplicaSet` exactly as ``backends/remote.py`` calls it (``pick`` with the prompt's text
  and the request's affinity, ``outstanding`` counted up on send and down at the end, the engines'
  load handed to ``observe`` every poll). ``affinity``: round robin with the request's key (for
  the CPU check: the first 200 characters, the ``prefix_affinity_chars`` mode).
- ``sglang``: SGLang router's cache-aware policy (sgl-router): an approximate tree per worker of
  the prompts sent to it; when the router's loads are imbalanced (max - min > ``abs_threshold``
  and max > ``rel_threshold`` x min) the least loaded worker, else the worker with the highest
  prefix match rate if above ``cache_threshold``, else the worker with the smallest tree. Its
  defaults in sglang_router's ``Router``: 0.5, 32, 1.0001 (newer releases: 0.3, 64, 1.5).
- ``llmd``: llm-d's inference scheduler with precise prefix-cache scoring: the engines' own cache
  blocks (its KV events; exact here), a waiting-queue scorer and a KV-cache utilization scorer
  from metrics scraped every 50 ms, weights 3 / 2 / 2 (llm-d's guide), the highest score wins,
  ties broken at random.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Protocol

from backends.engine_load import EngineLoad
from backends.replicas import Dispatch, Placement, ReplicaSet, ReplicaState
from policies.dispatch import PrefixIndex

if TYPE_CHECKING:
    from benchmarks.fleet_sim import Engine, Request, Sim

RULES: tuple[str, ...] = ("round_robin", "least_load", "prefix", "sglang", "llmd")


class Rule(Protocol):
    cost_ns: list[int]

    def attach(self, sim: Sim) -> None: ...
    def pick(self, q: Request) -> int | None: ...
    def sent(self, i: int, q: Request) -> None: ...
    def ended(self, i: int, q: Request) -> None: ...
    def poll(self, engines: list[Engine]) -> None: ...


class Gateway:
    """The gateway's :class:`ReplicaSet`, on the simulator's clock."""

    def __init__(
        self, strategy: str, balance: float | None = None, slack: float | None = None, **dispatch: float
    ) -> None:
        self.strategy = "round_robin" if strategy == "affinity" else strategy
        self.keyed = strategy == "affinity"
        self.params = {k: v for k, v in (("balance", balance), ("slack", slack)) if v is not None} | dispatch
        self.cost_ns: list[int] = []

    def attach(self, sim: Sim) -> None:
        p = sim.profile
        self.states = [ReplicaState(f"http://r{i}", None) for i in range(len(sim.engines))]
        d = Dispatch(
            block_tokens=p.block_tokens,
            bytes_per_token=4.0,
            cache_tokens=p.kv_tokens,
            **self.params,
        )
        self.set = ReplicaSet(self.states, self.strategy, cooldown_s=30.0, clock=lambda: sim.now, dispatch=d)
        self.at = {s.api_base: i for i, s in enumerate(self.states)}
        self.placed: dict[int, Placement] = {}

    def pick(self, q: Request) -> int | None:
        affinity = q.text[:200] if self.keyed else q.affinity
        t0 = time.perf_counter_ns()
        got = self.set.place(set(), affinity=affinity, text=q.text, background=q.background)
        self.cost_ns.append(time.perf_counter_ns() - t0)
        if got is None:
            return None
        self.placed[q.rid] = got
        return self.at[got.replica.api_base]

    def first(self, i: int, q: Request) -> None:
        if (placed := self.placed.pop(q.rid, None)) is not None:
            self.set.started(placed)

    def sent(self, i: int, q: Request) -> None:
        self.states[i].outstanding += 1

    def ended(self, i: int, q: Request) -> None:
        self.states[i].outstanding -= 1
        if q.answer:  # as the gateway does after an answer: the conversation so far is cached there
            self.set.extend(self.states[i], q.text + q.answer)

    def poll(self, engines: list[Engine]) -> None:
        for s, e in zip(self.states, engines, strict=True):
            self.set.observe(s, EngineLoad(e.running, len(e.waiting), e.kv_usage(), e.p.block_tokens, e.cap))


class SGLang:
    """SGLang router's cache-aware policy, its trees approximated by blocks of the prompt's bytes."""

    def __init__(self, cache_threshold: float = 0.5, abs_threshold: int = 32, rel_threshold: float = 1.0001) -> None:
        self.cache_threshold, self.abs_threshold, self.rel_threshold = cache_threshold, abs_threshold, rel_threshold
        self.cost_ns: list[int] = []

    def attach(self, sim: Sim) -> None:
        self.n = len(sim.engines)
        self.block_bytes = sim.profile.block_tokens * 4
        self.load = [0] * self.n  # the router's own count of requests in flight per worker
        self.tree = PrefixIndex([(1 << 24) // self.block_bytes] * self.n)  # max_tree_size: 2**24 characters

    def pick(self, q: Request) -> int | None:
        t0 = time.perf_counter_ns()
        i = self._choose(q)
        self.cost_ns.append(time.perf_counter_ns() - t0)
        return i

    def _choose(self, q: Request) -> int:
        load = self.load
        hi, lo = max(load), min(load)
        if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
            i = load.index(lo)
        else:
            depth, mask = self.tree.match(q.hashes, (1 << self.n) - 1)
            rate = depth * self.block_bytes / max(1, len(q.text.encode()))
            if depth and rate > self.cache_threshold:
                i = min((j for j in range(self.n) if mask >> j & 1), key=lambda j: load[j])
            else:
                i = min(range(self.n), key=self.tree.held)
        self.tree.add(i, q.hashes)
        return i

    def sent(self, i: int, q: Request) -> None:
        self.load[i] += 1

    def ended(self, i: int, q: Request) -> None:
        self.load[i] -= 1

    def poll(self, engines: list[Engine]) -> None:
        pass


class LLMD:
    """llm-d's scorers: precise prefix (weight 3), queue (2), KV-cache utilization (2)."""

    def __init__(self, w_prefix: float = 3.0, w_queue: float = 2.0, w_kv: float = 2.0, scrape_s: float = 0.05) -> None:
        self.w = (w_prefix, w_queue, w_kv)
        self.scrape_s = scrape_s
        self.cost_ns: list[int] = []
        self.rng = random.Random(0)

    def attach(self, sim: Sim) -> None:
        self.sim = sim
        self.n = len(sim.engines)
        self.scraped_at = -1.0
        self.waiting = [0] * self.n
        self.kv = [0.0] * self.n

    def _scrape(self) -> None:
        self.scraped_at = self.sim.now
        self.waiting = [len(e.waiting) for e in self.sim.engines]
        self.kv = [e.kv_usage() for e in self.sim.engines]

    def pick(self, q: Request) -> int | None:
        t0 = time.perf_counter_ns()
        if self.sim.now - self.scraped_at >= self.scrape_s:
            self._scrape()
        depth = self._depths(q.hashes)
        w_p, w_q, w_k = self.w
        d_hi, d_lo = max(depth), min(depth)
        q_hi, q_lo = max(self.waiting), min(self.waiting)
        best, chosen = -1.0, []
        for i in range(self.n):
            sp = (depth[i] - d_lo) / (d_hi - d_lo) if d_hi > d_lo else 1.0
            sq = (q_hi - self.waiting[i]) / (q_hi - q_lo) if q_hi > q_lo else 1.0
            s = w_p * sp + w_q * sq + w_k * (1.0 - self.kv[i])
            if s > best + 1e-12:
                best, chosen = s, [i]
            elif s > best - 1e-12:
                chosen.append(i)
        self.cost_ns.append(time.perf_counter_ns() - t0)
        return chosen[0] if len(chosen) == 1 else self.rng.choice(chosen)

    def _depths(self, hashes: tuple[int, ...]) -> list[int]:
        """Each engine's run of the prompt's blocks it holds (from the engines: KV events)."""
        depth = [0] * self.n
        holders = self.sim.holders
        alive, k = (1 << self.n) - 1, 0
        for h in hashes:
            nxt = alive & holders.get(h, 0)
            gone = alive & ~nxt
            while gone:
                b = gone & -gone
                depth[b.bit_length() - 1] = k
                gone ^= b
            alive, k = nxt, k + 1
            if not alive:
                return depth
        while alive:
            b = alive & -alive
            depth[b.bit_length() - 1] = k
            alive ^= b
        return depth

    def sent(self, i: int, q: Request) -> None:
        pass

    def ended(self, i: int, q: Request) -> None:
        pass

    def poll(self, engines: list[Engine]) -> None:
        pass


def make(name: str, **params: float) -> Rule:
    """A rule by name (``RULES``, or ``affinity``); ``params``: the prefix rule's balance and slack,
    or a Dispatch field such as ``batch_max_load``."""
    if name == "sglang":
        return SGLang()
    if name == "llmd":
        return LLMD()
    return Gateway(name, **params)
