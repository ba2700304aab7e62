"""Replica choice and ejection, on a fake clock (time is the one thing mocked here)."""

from __future__ import annotations

from collections import Counter

from backends.replicas import ReplicaSet, ReplicaState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(strategy: str, weights: tuple[int, ...] = (1, 1), cooldown: float = 10.0) -> tuple[ReplicaSet, Clock]:
    clock = Clock()
    states = [ReplicaState(f"http://r{i}", None, w) for i, w in enumerate(weights)]
    return ReplicaSet(states, strategy, cooldown, clock), clock  # type: ignore[arg-type]


def test_round_robin_respects_weights_and_spreads_evenly() -> None:
    rs, _ = make("round_robin", (3, 1))
    picks = [rs.pick(set()).api_base for _ in range(8)]
    assert Counter(picks) == {"http://r0": 6, "http://r1": 2}
    assert picks[:4].count("http://r1") == 1  # smooth: not r0 r0 r0 r1 bunched up front only by luck


def test_least_outstanding_prefers_the_idle_replica() -> None:
    rs, _ = make("least_outstanding")
    rs.replicas[0].outstanding = 3
    assert rs.pick(set()).api_base == "http://r1"
    rs.replicas[1].outstanding = 5
    assert rs.pick(set()).api_base == "http://r0"


def test_ejected_replica_is_skipped_until_the_cooldown_ends() -> None:
    rs, clock = make("round_robin")
    rs.eject(rs.replicas[0])
    assert {rs.pick(set()).api_base for _ in range(4)} == {"http://r1"}
    assert rs.any_available()
    clock.now += 10.0
    assert {rs.pick(set()).api_base for _ in range(4)} == {"http://r0", "http://r1"}


def test_retry_prefers_untried_then_falls_back_to_any() -> None:
    rs, _ = make("round_robin")
    first = rs.pick(set())
    second = rs.pick({first.api_base})
    assert second.api_base != first.api_base
    rs.eject(rs.replicas[0])
    rs.eject(rs.replicas[1])
    assert not rs.any_available()
    assert rs.pick({"http://r0", "http://r1"}).api_base in {"http://r0", "http://r1"}


def test_failed_active_check_takes_a_replica_out() -> None:
    rs, _ = make("least_outstanding")
    rs.replicas[1].active_ok = False
    assert {rs.pick(set()).api_base for _ in range(3)} == {"http://r0"}
