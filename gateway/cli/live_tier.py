"""The eval's live model tier: a policy's backends started as the gateway starts them, and each
row asked through ``gateway.service.tier_answers.answer``, the gateway's own code path. It lives in the
CLI's room, the one part of the gateway that may import ``eval/`` (serving never does; ``eval/``
imports nothing of the gateway): ``triage eval`` hands it to the eval as one more ``Compute``."""

from __future__ import annotations

import asyncio
from pathlib import Path

from eval.tier_outputs import Row
from eval.tier_runs import Compute
from gateway.service import assemble
from gateway.service.context import Context
from gateway.service.service import Service
from gateway.service.tier_answers import answer
from policies.cascade import Ask, TierAnswer
from policies.schema import Policy
from policies.tiers import ModelTier


class Live:
    """A policy's model tier asked for real: the policy's backends started as the gateway starts
    them, each row through ``gateway.service.tier_answers.answer`` (the gateway's own code path), one at a time."""

    def __init__(self, policy: Policy, base_dir: Path) -> None:
        self._loop = asyncio.new_event_loop()
        self._rt = self._loop.run_until_complete(assemble.build(policy, None, base_dir))

    def compute(self, tier: ModelTier) -> Compute:
        def run(row: Row) -> TierAnswer:
            ask = Ask(tier.name, tier.type, row.question)
            ctx = Context(f"eval-{row.id}", surface="eval")
            return self._loop.run_until_complete(answer(self._rt, tier, ask, ctx, Service(self._rt).serve_tier))

        return run

    def close(self) -> None:
        for backend in self._rt.backends.values():
            self._loop.run_until_complete(backend.close())
        if self._rt.encoding is not None:
            self._loop.run_until_complete(self._rt.encoding.close())
        if self._rt.watch is not None:  # a policy with a quality section: its writer's loop
            self._loop.run_until_complete(self._rt.watch.close())
        self._loop.close()
