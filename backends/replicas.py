"""Replica choice and health: load balancing, passive ejection, active checks' bookkeeping.

Pure state, no I/O: the remote backends drive it. ``clock`` is injectable for tests.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Strategy = Literal["round_robin", "least_outstanding"]


@dataclass
class ReplicaState:
    api_base: str
    api_key: str | None
    weight: int = 1
    outstanding: int = 0
    ejected_until: float = 0.0
    active_ok: bool = True  # the last active health check passed (or none ran yet)
    current_weight: int = field(default=0, repr=False)  # smooth weighted round-robin

    def available(self, now: float) -> bool:
        return self.active_ok and now >= self.ejected_until


class ReplicaSet:
    def __init__(
        self,
        replicas: list[ReplicaState],
        strategy: Strategy,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        self.replicas = replicas
        self.strategy = strategy
        self.cooldown_s = cooldown_s
        self.clock = clock

    def any_available(self) -> bool:
        now = self.clock()
        return any(r.available(now) for r in self.replicas)

    def pick(self, tried: set[str], affinity: str | None = None) -> ReplicaState:
        """The next replica to try; untried and available ones first, then untried, then any.
        With an ``affinity`` key (a batch's prefix group), the same key goes to the same replica
        while it is available (rendezvous hashing), so that replica's prefix cache stays warm."""
        now = self.clock()
        pools = (
            [r for r in self.replicas if r.api_base not in tried and r.available(now)],
            [r for r in self.replicas if r.api_base not in tried],
            self.replicas,
        )
        candidates = next(p for p in pools if p)
        if affinity is not None:
            return max(
                candidates, key=lambda r: hashlib.blake2b(f"{affinity}|{r.api_base}".encode(), digest_size=8).digest()
            )
        if self.strategy == "least_outstanding":
            return min(candidates, key=lambda r: (r.outstanding / r.weight, r.ejected_until))
        return self._smooth_weighted(candidates)

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

    def eject(self, replica: ReplicaState) -> None:
        replica.ejected_until = self.clock() + self.cooldown_s

    def restore(self, replica: ReplicaState) -> None:
        replica.ejected_until = 0.0
