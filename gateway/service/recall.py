"""The cascade's memory of escalations, served (``policies/memory.py``): the nearest questions the
last tier answered, shown as solved examples to the tiers with ``examples: true``, and each answer
of the last tier (an escalation, or a shadow check of a kept answer) remembered. Each gateway keeps
its ring (a reload whose `memory` section is unchanged keeps it); with the state in Redis the fleet
shares them (``gateway/state/memory_redis.py``), else a restart starts it empty."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from gateway.state.memory_redis import MemoryFeed
from policies.cascade import Ask, Decision, Question, TierAnswer
from policies.memory import Example, Memory, with_examples
from policies.tiers import Cascade, Tier


def recall(
    memory: Memory | None, spec: Cascade, q: Question, embedding: np.ndarray | None, feed: MemoryFeed | None = None
) -> list[Example]:
    """The nearest solved questions; with the fleet's ``feed``, a read of the others' answers is
    started (never waited on: they serve the next questions)."""
    if feed is not None:
        feed.freshen()
    if memory is None or spec.memory is None or embedding is None or q.numeric:
        return []
    return memory.nearest(embedding, q, spec.memory.examples, spec.memory.min_similarity)


def shown(tier: Tier, ask: Ask, examples: Sequence[Example]) -> Ask:
    """The ask as ``tier`` gets it: with the examples before the question's context where it takes them."""
    if not tier.examples or not examples:
        return ask
    return dataclasses.replace(ask, question=with_examples(ask.question, list(examples)))


def said(tier: Tier, answer: TierAnswer, examples: Sequence[Example]) -> TierAnswer:
    """The answer, saying how many examples its tier was shown and how close the nearest was."""
    if not tier.examples or not examples:
        return answer
    return dataclasses.replace(answer, examples=(len(examples), examples[0].similarity))


def remember(
    memory: Memory | None,
    spec: Cascade,
    q: Question,
    embedding: np.ndarray | None,
    d: Decision,
    feed: MemoryFeed | None = None,
) -> None:
    """Keep the last tier's answer (not a cached decision's, nor a number's: no options to show), and
    share it with the fleet through ``feed``."""
    if memory is None or embedding is None or q.numeric or d.cached or d.tier != spec.tiers[-1].name:
        return
    keep(memory, feed, embedding, q, d.answer)


def keep(memory: Memory, feed: MemoryFeed | None, embedding: np.ndarray, q: Question, answer: str) -> None:
    """The last tier's ``answer`` in this gateway's ring, and shared through the fleet's ``feed``."""
    memory.add(embedding, q, answer)
    if feed is not None:
        feed.push(embedding, q, answer)
