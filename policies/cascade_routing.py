"""Route and cascade as one decision for a typed question (issue 56), served. Pure: no I/O, no clock.

With the cascade's ``routing``, a question with options whose type it covers is not asked of the
tiers in their listed order: before each call the next tier is chosen among those not asked by what
its answer is expected to add to the votes' calibrated P(right), less ``knob`` times its expected
cost (:func:`policies.pool_routing.step`, three steps ahead), and the decision stops when no tier is
worth more than stopping. Each tier's prior is its ``accuracy`` for the type (a tier with none, or
barred for this request, is never asked); its expected cost is its ``prices``: ``per_call`` plus
``per_1k_tokens`` for the question's tokens (estimated as its characters / 4) and a short answer.
The answer is the votes' top option (:mod:`policies.agreement`), its confidence their calibrated
P(right); each step of the trace carries the votes so far and the tier chosen next (``next``: a
tier's name, or ``stop``). A tier that fails is not asked again, and until one tier has answered
another is asked whatever it is worth; when none answered, the request ends as an exhausted cascade.
Any other question takes the listed order (:func:`policies.cascade.steps`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from policies.agreement import agree
from policies.cascade import (
    Ask,
    CascadeExhausted,
    Decision,
    Gate,
    Outcome,
    Question,
    Reading,
    Step,
    TierAnswer,
    ballot,
    read,
    steps,
)
from policies.pool import NO_ANSWER, Agreement
from policies.pool_routing import step

ANSWER_TOKENS = 8  # a letter, a word or a number, as a typed tier's answer


@dataclass(frozen=True)
class Routing:
    knob: float  # P(right) given up per unit of the tiers' prices
    agreement: Mapping[str, Agreement]  # per type: how far the votes are trusted

    def covers(self, q: Question, gates: Sequence[Gate]) -> bool:
        return not q.numeric and q.type in self.agreement and any(q.type in g.accuracy for g in gates)


def expected_cost(gate: Gate, q: Question) -> float:
    chars = len(q.question) + len(q.context or "") + sum(len(o) + 4 for o in q.options)
    return gate.per_call + gate.per_1k_tokens * (chars / 4 + ANSWER_TOKENS) / 1000


def steps_for(
    q: Question,
    gates: Sequence[Gate],
    on_exhausted: Literal["error", "best"] = "error",
    embedding: np.ndarray | None = None,
    routing: Routing | None = None,
) -> Generator[Ask, TierAnswer, Decision]:
    """The cascade for ``q``: routed where ``routing`` covers it, else tier after tier."""
    if routing is not None and routing.covers(q, gates):
        return routed(q, gates, routing)
    return steps(q, gates, on_exhausted, embedding)


def routed(q: Question, gates: Sequence[Gate], routing: Routing) -> Generator[Ask, TierAnswer, Decision]:
    ag = routing.agreement[q.type]
    index: dict[str, int] = {}
    for i, o in enumerate(q.options):
        index.setdefault(o, i)
    prior = np.array([g.accuracy.get(q.type, np.nan) if g.barred is None else np.nan for g in gates])
    cost = np.array([expected_cost(g, q) for g in gates])
    asked = np.zeros(len(gates), dtype=bool)
    answers = np.full(len(gates), NO_ANSWER, dtype=np.int64)
    trace: list[Step] = []  # one step a tier asked, in the order asked (the barred ones after them)
    barred = [Step(g.name, "skipped", 0.0, error=g.barred) for g in gates if g.barred is not None]
    answered: list[tuple[Gate, Reading, bool]] = []
    usage: dict[str, Mapping[str, int] | None] = {}
    while True:
        nxt, _, _ = step(asked[None], answers[None], prior[None], cost[None], len(q.options), ag, routing.knob)
        n = int(nxt[0])
        if trace:  # the step just taken says what was decided after it
            trace[-1] = dataclasses.replace(trace[-1], next=gates[n].name if n >= 0 else "stop")
        if n < 0:
            break
        gate = gates[n]
        answer = yield Ask(gate.name, gate.kind, q)
        if answer.skipped or answer.error is not None:  # never asked again, and not counted as asked: until
            prior[n] = np.nan  # a tier answers, one more is asked whatever it is worth
            outcome: Outcome = "skipped" if answer.skipped else "failed"
            trace.append(
                Step(gate.name, outcome, answer.latency_ms, error=answer.error, model=answer.model, usage=answer.usage)
            )
            continue
        reading = read(q, gate, answer)
        asked[n] = True
        answers[n] = index[reading.answer]
        answered.append((gate, reading, answer.assumed))
        usage[gate.name] = answer.usage
        v = agree(q.options, ballot(q, answered), ag)
        trace.append(
            Step(
                gate.name,
                "escalated",
                answer.latency_ms,
                v.answer,
                v.confidence,
                None,
                model=answer.model,
                raw_confidence=reading.confidence,
                usage=answer.usage,
                votes={g.name: r.answer for g, r, _ in answered},
                agreeing=v.agreeing,
                examples=answer.examples,
            )
        )
    if not answered:
        failed = [f"{s.tier}: {s.error}" for s in trace + barred if s.outcome in ("failed", "skipped")]
        why = "no tier answered the routed question" + (f" ({'; '.join(failed)})" if failed else "")
        raise CascadeExhausted(why, trace + barred)
    v = agree(q.options, ballot(q, answered), ag)
    at = max(i for i, s in enumerate(trace) if s.votes is not None)  # the last answer: the votes are final there
    trace[at] = dataclasses.replace(trace[at], outcome="accepted")
    tier = trace[at].tier
    return Decision(v.answer, v.probabilities, v.confidence, tier, tuple(trace + barred), usage[tier], q.type, False)
