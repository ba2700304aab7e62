"""The eval's live model tier: a policy's backends started as the gateway starts them, and each
row asked through ``gateway.service.tier_answers.answer``, the gateway's own code path. It lives in the
CLI's room, the one part of the gateway that may import ``eval/`` (serving never does; ``eval/``
imports nothing of the gateway): ``triage eval`` hands it to the eval as one more ``Compute``."""

from __future__ import annotations

from pathlib import Path

from eval.tier_outputs import Row
from eval.tier_runs import Compute
from gateway.embedded import Gateway
from gateway.service.context import Context
from gateway.service.service import Service
from gateway.service.tier_answers import answer
from policies.cascade import Ask, TierAnswer
from policies.schema import Policy
from policies.tiers import ModelTier


class Live:
    """A policy's model tier asked for real: the policy served in-process (:class:`gateway.Gateway`:
    its backends started as the gateway starts them, on a loop of its own), each row through
    ``gateway.service.tier_answers.answer`` (the gateway's own code path), one at a time."""

    def __init__(self, policy: Policy, base_dir: Path) -> None:
        self._gw = Gateway(policy, base_dir=base_dir).open()

    def compute(self, tier: ModelTier) -> Compute:
        def run(row: Row) -> TierAnswer:
            ask = Ask(tier.name, tier.type, row.question)
            ctx = Context(f"eval-{row.id}", surface="eval")
            rt = self._gw.runtime
            return self._gw.run(answer(rt, tier, ask, ctx, Service(rt).serve_tier))

        return run

    def close(self) -> None:
        self._gw.close()
