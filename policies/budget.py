"""An online escalation budget for the cascade: holds the share of questions its first tier sends
on near a target under shifting traffic. Pure: the gateway asks for the shifted thresholds when
it builds a question's gates and reports each decision's first step.

The controller is a stochastic approximation (Robbins-Monro): one offset is added to the
thresholds of every tier but the last; after each question the first tier answered, the offset
moves down by ``step * (1 - target)`` when it escalated and up by ``step * target`` when it kept
the question, so that it rests where the escalated share equals the target. The offset stays
within ``[-max_shift, +max_shift]`` and no shifted threshold goes below ``floor``, the quality
floor: when traffic is so hard that the budget would need thresholds under it, the cascade
escalates more than the budget rather than keep answers it cannot trust. A window of the last
``window`` outcomes gives the share the metrics report.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from policies.cascade import Gate, Step


@dataclass
class EscalationBudget:
    target: float  # share of questions the first tier may escalate
    step: float = 0.01
    max_shift: float = 0.3
    floor: float = 0.0
    window: int = 500
    offset: float = 0.0
    _recent: deque[bool] = field(default_factory=deque)

    def shifted(self, thresholds: Mapping[str, float]) -> dict[str, float]:
        """A first tier's thresholds with the offset, within [floor, 1] (a floor above a tier's own
        threshold leaves that threshold where it is)."""
        return {k: min(1.0, max(min(self.floor, v), v + self.offset)) for k, v in thresholds.items()}

    def gates(self, gates: list[Gate]) -> list[Gate]:
        """Every gate but the last with its thresholds shifted."""
        out = [
            replace(g, thresholds=self.shifted(g.thresholds), task_thresholds=self.shifted(g.task_thresholds))
            for g in gates[:-1]
        ]
        return [*out, *gates[-1:]]

    def observe(self, first: Step) -> None:
        """The first step of a decision's trace: only questions the first tier answered count (one it
        skipped or failed on was never the thresholds' to keep)."""
        if first.outcome not in ("accepted", "escalated"):
            return
        escalated = first.outcome == "escalated"
        move = -self.step * (1 - self.target) if escalated else self.step * self.target
        self.offset = min(self.max_shift, max(-self.max_shift, self.offset + move))
        self._recent.append(escalated)
        while len(self._recent) > self.window:
            self._recent.popleft()

    @property
    def share(self) -> float | None:
        """The escalated share over the window (None before any question)."""
        return sum(self._recent) / len(self._recent) if self._recent else None
