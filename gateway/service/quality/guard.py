"""The guard of guarded rollouts: which split candidates are rolled back to their primary
(the rule: :func:`policies.rollouts.verdict`; the evidence: the quality store's counts).

Each gateway process judges for itself from the store every ``quality.check_every_s``; on a store
the fleet shares (PostgreSQL) they all read the same counts, so they reach the same verdict. A
rollback holds while the split's weights stay as they were (its :func:`~policies.rollouts.signature`):
a reload that changes them starts the split afresh, its evidence counted from then. A process that
starts judges the traffic in the guard's window since it started.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import structlog

from gateway.state.quality import QualityStore
from policies import quality, rollouts
from policies.rollouts import Rollback
from policies.schema import SplitModel

log = structlog.get_logger("triage.quality")


@dataclasses.dataclass(slots=True)
class Held:
    signature: str
    since: float  # when this process first saw these weights: the evidence starts here
    gone: dict[str, tuple[Rollback, float]] = dataclasses.field(default_factory=dict)  # target -> why, when


class Guard:
    """The guarded splits of the current policy and their rollbacks (one per quality watch)."""

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self.now = now
        self.splits: dict[str, SplitModel] = {}
        self.held: dict[str, Held] = {}
        self.rollbacks_total = 0

    def watch(self, splits: Mapping[str, SplitModel]) -> None:
        """The policy's guarded splits (at each assembly): a split whose weights changed, or that is
        gone, forgets its rollbacks at once, before any request of the new policy."""
        self.splits = {name: vm for name, vm in splits.items() if vm.guard is not None}
        for name in list(self.held):
            vm = self.splits.get(name)
            if vm is None or rollouts.signature(vm.targets.items()) != self.held[name].signature:
                del self.held[name]
        for name, vm in self.splits.items():
            self.held.setdefault(name, Held(rollouts.signature(vm.targets.items()), self.now()))

    def gone(self, split: str) -> dict[str, tuple[Rollback, float]] | None:
        """The rolled-back targets of ``split`` (None: none); one dict lookup on the request's path."""
        held = self.held.get(split)
        return held.gone if held is not None and held.gone else None

    async def judge(self, store: QualityStore) -> None:
        """Read each guarded split's evidence and roll back the candidates that cross a bound."""
        now = self.now()
        for name, vm in list(self.splits.items()):
            held, guard = self.held.get(name), vm.guard
            if held is None or guard is None:
                continue
            since = max(now - guard.window_s, held.since)
            rows = [quality.Counts(**dataclasses.asdict(r)) for r in await store.counts(since)]
            primary = rollouts.primary_of(vm.targets.items(), guard)
            for found in rollouts.verdict(name, guard, primary, rows):
                if found.target in held.gone:
                    continue
                held.gone[found.target] = (found, now)
                self.rollbacks_total += 1
                log.warning(
                    "rollout_rolled_back",
                    split=name,
                    target=found.target,
                    primary=primary,
                    reason=found.reason,
                    requests=found.requests,
                    errors=found.errors,
                    pairs=found.pairs,
                )

    def report(self) -> list[dict[str, object]]:
        """Every rollback held, for the console, ``triage quality`` and ``/admin/quality``."""
        out: list[dict[str, object]] = []
        for name, held in sorted(self.held.items()):
            vm = self.splits.get(name)
            primary = rollouts.primary_of(vm.targets.items(), vm.guard) if vm is not None else None
            for target, (r, at) in sorted(held.gone.items()):
                out.append(
                    {
                        "split": name,
                        "target": target,
                        "primary": primary,
                        "reason": r.reason,
                        "at": round(at, 3),
                        "requests": r.requests,
                        "errors": r.errors,
                        "pairs": r.pairs,
                        "agree": r.agree,
                    }
                )
        return out
