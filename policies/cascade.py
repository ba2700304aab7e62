"""The confidence-gated cascade, as one sans-I/O generator. Pure: no I/O, no clock.

``run(question, gates)`` yields an :class:`Ask` for each tier it wants an answer from and is sent
back a :class:`TierAnswer`; it returns the :class:`Decision` with its trace. The gateway drives
it against live tiers, the eval against live or recorded tier outputs: one implementation.

Confidence, per question type (after the tier's temperature for that type):
- ``choice`` and ``score`` (with a scale): the probability of the top option;
- ``yes_no``: the margin ``|p(yes) - p(no)| = 2 * max(p) - 1``, in [0, 1]. ``max(p, 1 - p)``
  never falls below 0.5, so on that scale a threshold fitted for ``choice`` would hardly ever
  escalate a yes/no question; the margin spreads yes/no answers over the whole [0, 1] range.
A tier accepts when its confidence reaches its threshold for the type (a task threshold, where
the question names a task the tier has one for, wins); a type with no threshold is never
accepted by that tier. A judged tier with an ``escalation_margin`` also needs its P(right) to
come within that margin of P(escalating gets it right) on such questions (the judge's record of
the last tier on the nearest fitting questions): a threshold alone keeps answers that are likely
right but less likely than what escalating would give. The last tier that answers is accepted
whatever its confidence.
A tier with ``agreement`` for the question's type (a question with options) reads the answers of
every tier so far as votes (:mod:`policies.agreement`): its answer is the votes' top option and its
confidence their calibrated P(right), fitted on dev rows, so a tier that returned no probabilities
is gated on a measured number; the trace names each tier's answer and those that agree.
A tier that fails, times out or cannot take the question escalates and says so in the trace.
When no tier answers, or the last tier failed after earlier ones answered below their
thresholds, ``on_exhausted`` decides: ``error`` (the gateway answers 502 with the trace) or
``best`` (the most confident answer seen, marked ``exhausted``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from policies.agreement import Vote, agree
from policies.errors import UpstreamError
from policies.pool import Agreement
from policies.tiers import QuestionType

YES_NO = ("yes", "no")


@dataclass(frozen=True)
class Question:
    type: QuestionType
    question: str
    options: tuple[str, ...]  # choice: as given; yes_no: ("yes", "no"); score: the scale's values
    context: str | None = None
    task: str | None = None
    scale: tuple[int, int] | None = None

    @property
    def numeric(self) -> bool:
        """A number with no scale (GSM8K and the like): generation, not a choice among options."""
        return self.type == "score" and self.scale is None


@dataclass(frozen=True)
class Signals:
    """One tier's answer to one question, as a learned gate reads it (``classifiers.confidence``)."""

    qtype: str  # choice | yes_no | score
    probabilities: Sequence[float]  # per option, after the tier's temperature
    context: bool = False
    question_chars: int = 0
    previous_top: float | None = None  # the tier asked before: its top probability (None: no tier before)
    previous_agrees: bool = False  # ... and whether it gave the same answer
    embedding: np.ndarray | None = field(default=None, compare=False)


class Judge(Protocol):
    """A learned gate (``classifiers.confidence.ConfidenceModel``): P(the tier's answer is right)."""

    @property
    def needs_embedding(self) -> bool: ...

    @property
    def uses_embedding(self) -> bool: ...

    def p_right(self, s: Signals) -> float: ...

    def p_after(self, s: Signals) -> float | None: ...


@dataclass(frozen=True)
class Gate:
    """One tier as the cascade sees it: its name, kind, and its numbers per question type; with a
    ``judge``, the threshold is compared with the judge's P(right) instead of the tier's own confidence."""

    name: str
    kind: str  # "encoder", "scorer", "model", "recorded"
    thresholds: Mapping[str, float] = field(default_factory=dict)
    task_thresholds: Mapping[str, float] = field(default_factory=dict)
    temperatures: Mapping[str, float] = field(default_factory=dict)
    judge: Judge | None = None
    task_temperatures: Mapping[str, float] = field(default_factory=dict)
    escalation_margin: float | None = None  # with a judge: keep only if P(right) >= P(escalating right) - this
    barred: str | None = None  # why this tier may not be asked for this request (skipped, never asked)
    accuracy: Mapping[str, float] = field(default_factory=dict)  # per type: this tier's answer's weight as a vote
    agreement: Mapping[str, Agreement] = field(default_factory=dict)  # per type: its confidence is the votes'
    per_call: float = 0.0  # its prices, for a routed cascade's expected cost (policies/cascade_routing.py)
    per_1k_tokens: float = 0.0

    def temperature(self, q: Question) -> float:
        if q.task is not None and q.task in self.task_temperatures:
            return self.task_temperatures[q.task]
        return self.temperatures.get(q.type, 1.0)

    def threshold(self, q: Question) -> float | None:
        if q.task is not None and q.task in self.task_thresholds:
            return self.task_thresholds[q.task]
        return self.thresholds.get(q.type)


@dataclass(frozen=True)
class Ask:
    tier: str
    kind: str
    question: Question


@dataclass(frozen=True)
class TierAnswer:
    """What a tier said: log-scores per option (any additive constant; the cascade normalises),
    or for a numeric question the extracted number as ``text`` with a ``confidence``."""

    scores: tuple[float, ...] | None = None
    latency_ms: float = 0.0
    error: str | None = None
    skipped: bool = False  # the tier cannot take this question (no weights for its type, ...)
    text: str | None = None
    confidence: float | None = None
    usage: Mapping[str, int] | None = None
    model: str | None = None  # a model tier's: the policy model that answered (a routed tier's choice)
    assumed: bool = False  # the tier gave no probabilities: these are its `assumed_confidence`, not measured
    examples: tuple[int, float] | None = None  # asked with remembered examples: how many, the nearest's similarity


Outcome = Literal["accepted", "escalated", "failed", "skipped", "exhausted"]


@dataclass(frozen=True)
class Step:
    tier: str
    outcome: Outcome
    latency_ms: float
    answer: str | None = None
    confidence: float | None = None
    threshold: float | None = None
    error: str | None = None
    model: str | None = None  # the policy model that answered, for a model tier
    assumed: bool = False  # the confidence is the tier's assumed one: the engine gave no probabilities
    raw_confidence: float | None = None  # with a learned gate: the tier's own (``confidence`` is P(right))
    escalation: float | None = None  # with an escalation margin: P(escalating gets it right)
    usage: Mapping[str, int] | None = None  # what asking this tier used (a model tier's is priced)
    votes: Mapping[str, str] | None = None  # with agreement: each tier's answer so far (the confidence is theirs)
    agreeing: tuple[str, ...] | None = None  # ... and the tiers whose answer this one is
    next: str | None = None  # routed (policies/cascade_routing.py): the tier chosen after this step, or "stop"
    examples: tuple[int, float] | None = None  # asked with this many remembered examples, the nearest this close

    def as_dict(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "outcome": self.outcome,
            "answer": self.answer,
            "confidence": _round(self.confidence),
            "threshold": self.threshold,
            "latency_ms": round(self.latency_ms, 3),
            **({"error": self.error} if self.error else {}),
            **({"model": self.model} if self.model else {}),
            **({"probabilities": "assumed"} if self.assumed else {}),
            **({"raw_confidence": _round(self.raw_confidence)} if self.raw_confidence is not None else {}),
            **({"escalation_p_right": _round(self.escalation)} if self.escalation is not None else {}),
            **({"votes": dict(self.votes), "agreeing": list(self.agreeing or ())} if self.votes is not None else {}),
            **({"next": self.next} if self.next is not None else {}),
            **(
                {"examples": self.examples[0], "nearest_similarity": round(self.examples[1], 4)}
                if self.examples is not None
                else {}
            ),
        }


@dataclass(frozen=True)
class Decision:
    answer: str
    probabilities: dict[str, float]
    confidence: float
    tier: str
    trace: tuple[Step, ...]
    usage: Mapping[str, int] | None = None
    qtype: str = "choice"
    assumed: bool = False  # the probabilities are the answering tier's assumed confidence, not measured
    cached: bool | None = None  # from the decision cache (None: the cache is off)


class CascadeExhausted(UpstreamError):
    """No tier gave an answer the policy accepts: a 502 that carries the trace."""

    default_code = "cascade_exhausted"

    def __init__(self, message: str, trace: Sequence[Step]) -> None:
        super().__init__(message, retryable=False)
        self.trace = tuple(trace)

    def body(self) -> dict[str, object]:
        body = super().body()
        body["error"]["trace"] = [s.as_dict() for s in self.trace]
        return body


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def softmax(scores: Sequence[float], temperature: float = 1.0) -> list[float]:
    z = [s / temperature for s in scores]
    m = max(z)
    e = [math.exp(v - m) for v in z]
    total = sum(e)
    return [v / total for v in e]


def confidence(qtype: str, probs: Sequence[float]) -> float:
    top = max(probs)
    return max(0.0, 2.0 * top - 1.0) if qtype == "yes_no" else top


@dataclass(frozen=True)
class Reading:
    answer: str
    probabilities: dict[str, float]
    confidence: float

    @property
    def confidence_top(self) -> float:
        """The top option's probability (for yes_no, not the margin)."""
        return max(self.probabilities.values())


def read(q: Question, gate: Gate, answer: TierAnswer) -> Reading:
    """A tier's answer, calibrated and read on the question type's confidence scale."""
    if q.numeric:
        assert answer.text is not None
        conf = answer.confidence if answer.confidence is not None else 0.0
        return Reading(answer.text, {answer.text: conf}, conf)
    assert answer.scores is not None and len(answer.scores) == len(q.options)
    probs = softmax(answer.scores, gate.temperature(q))
    best = max(range(len(probs)), key=probs.__getitem__)
    merged: dict[str, float] = {}
    for option, p in zip(q.options, probs, strict=True):  # a repeated option text: one key, summed
        merged[option] = merged.get(option, 0.0) + p
    return Reading(q.options[best], merged, confidence(q.type, probs))


def signals(q: Question, reading: Reading, previous: Reading | None, embedding: np.ndarray | None) -> Signals:
    """What a learned gate reads of one tier's answer (``previous``: the tier that answered before it)."""
    return Signals(
        q.type,
        tuple(reading.probabilities.values()),
        bool(q.context),
        len(q.question),
        previous.confidence_top if previous is not None else None,
        previous is not None and previous.answer == reading.answer,
        embedding,
    )


def ballot(q: Question, answered: Sequence[tuple[Gate, Reading, bool]]) -> list[Vote]:
    """The tiers' answers so far as votes: each at its accuracy for the question's type, with its
    probabilities where it measured them (``assumed``: it gave none)."""
    return [
        Vote(g.name, r.answer, g.accuracy.get(q.type), None if assumed else r.probabilities)
        for g, r, assumed in answered
    ]


@dataclass(frozen=True)
class Votes:
    """What a tier with agreement read: the votes' reading, each tier's answer, and those that agree."""

    reading: Reading
    answers: dict[str, str]
    agreeing: tuple[str, ...]


def agreed(q: Question, gate: Gate, answered: Sequence[tuple[Gate, Reading, bool]]) -> Votes | None:
    """With ``agreement`` for the question's type (a question with options): the reading of the votes
    of the tiers that answered (``gate``'s last); else None."""
    ag = gate.agreement.get(q.type)
    if ag is None or q.numeric:
        return None
    a = agree(q.options, ballot(q, answered), ag)
    return Votes(
        Reading(a.answer, a.probabilities, a.confidence), {g.name: r.answer for g, r, _ in answered}, a.agreeing
    )


def task_head(gate: Gate, q: Question) -> bool:
    """The encoder answers a question that names a task with that task's head, not the option scorer."""
    return gate.kind == "encoder" and q.task is not None


def judged(
    q: Question, gate: Gate, reading: Reading, previous: Reading | None, embedding: np.ndarray | None
) -> float | None:
    """The judge's P(right) of a tier's answer, where the tier has a judge that can read this
    question (a number has no options to read; the encoder answers a task's question with the task's
    head, calibrated on its own data; a judge of embeddings needs one); else None."""
    judge = gate.judge
    if judge is None or q.numeric or (judge.needs_embedding and embedding is None) or task_head(gate, q):
        return None
    return judge.p_right(signals(q, reading, previous, embedding))


def after(
    q: Question, gate: Gate, reading: Reading, previous: Reading | None, embedding: np.ndarray | None
) -> float | None:
    """With an escalation margin on a judged tier: P(escalating gets this question right), what
    the tier's P(right) must come within the margin of to keep its answer; else None."""
    judge = gate.judge
    if judge is None or gate.escalation_margin is None or embedding is None or q.numeric or task_head(gate, q):
        return None
    return judge.p_after(signals(q, reading, previous, embedding))


def keeps(conf: float, threshold: float | None, p_after: float | None, margin: float | None) -> bool:
    """Whether a tier that is not the last keeps its answer."""
    if threshold is None or conf < threshold:
        return False
    return p_after is None or margin is None or conf >= p_after - margin


def gated(q: Question, gate: Gate, reading: Reading, previous: Reading | None, embedding: np.ndarray | None) -> float:
    """The confidence the gate compares with the threshold: the judge's, else the tier's own."""
    p = judged(q, gate, reading, previous, embedding)
    return reading.confidence if p is None else p


def _decided(
    q: Question, gate: Gate, reading: Reading, answer: TierAnswer, trace: list[Step], conf: float, assumed: bool
) -> Decision:
    return Decision(reading.answer, reading.probabilities, conf, gate.name, tuple(trace), answer.usage, q.type, assumed)


def steps(
    q: Question,
    gates: Sequence[Gate],
    on_exhausted: Literal["error", "best"] = "error",
    embedding: np.ndarray | None = None,
) -> Generator[Ask, TierAnswer, Decision]:
    """Ask tier after tier until one is confident enough; return the decision and its trace.
    ``embedding``: the question's, for learned gates that read it."""
    if not gates:
        raise ValueError("a cascade needs at least one tier")
    open_ = [i for i, g in enumerate(gates) if g.barred is None]
    if not open_:
        raise ValueError("every tier is barred: the edge refuses such a request before the cascade runs")
    trace: list[Step] = []
    best: tuple[Reading, Gate, TierAnswer, float, bool] | None = None
    previous: Reading | None = None
    answered: list[tuple[Gate, Reading, bool]] = []
    for i, gate in enumerate(gates):
        if gate.barred is not None:
            trace.append(Step(gate.name, "skipped", 0.0, error=gate.barred))
            continue
        answer = yield Ask(gate.name, gate.kind, q)
        if answer.skipped or answer.error is not None:
            outcome: Outcome = "skipped" if answer.skipped else "failed"
            trace.append(
                Step(
                    gate.name,
                    outcome,
                    answer.latency_ms,
                    error=answer.error,
                    model=answer.model,
                    usage=answer.usage,
                    examples=answer.examples,
                )
            )
            continue
        reading = read(q, gate, answer)
        answered.append((gate, reading, answer.assumed))
        own, assumed = reading, answer.assumed
        if (votes := agreed(q, gate, answered)) is not None:  # the votes are its confidence, fitted: not assumed
            reading, assumed = votes.reading, False
        p_right = None if votes is not None else judged(q, gate, reading, previous, embedding)
        conf = reading.confidence if p_right is None else p_right
        raw = own.confidence if p_right is not None or votes is not None else None
        threshold = gate.threshold(q)
        last = i == open_[-1]
        p_after = None if last or p_right is None else after(q, gate, reading, previous, embedding)
        accepted = last or keeps(conf, threshold, p_after, gate.escalation_margin)
        trace.append(
            Step(
                gate.name,
                "accepted" if accepted else "escalated",
                answer.latency_ms,
                reading.answer,
                conf,
                threshold,
                model=answer.model,
                assumed=assumed,
                raw_confidence=raw,
                usage=answer.usage,
                escalation=p_after,
                votes=None if votes is None else votes.answers,
                agreeing=None if votes is None else votes.agreeing,
                examples=answer.examples,
            )
        )
        if accepted:
            if last:  # the tiers after the last open one are barred: said in the trace
                trace += [Step(g.name, "skipped", 0.0, error=g.barred) for g in gates[i + 1 :]]
            return _decided(q, gate, reading, answer, trace, conf, assumed)
        if best is None or conf > best[3]:
            best = (reading, gate, answer, conf, assumed)
        previous = own
    if on_exhausted == "best" and best is not None:
        reading, gate, answer, conf, assumed = best
        trace.append(Step(gate.name, "exhausted", 0.0, reading.answer, conf, None))
        return _decided(q, gate, reading, answer, trace, conf, assumed)
    failed = [f"{s.tier}: {s.error}" for s in trace if s.outcome in ("failed", "skipped")]
    raise CascadeExhausted(
        "no tier could answer the question with accepted confidence" + (f" ({'; '.join(failed)})" if failed else ""),
        trace,
    )


def drive(gen: Generator[Ask, TierAnswer, Decision], answer_for: Callable[[Ask], TierAnswer]) -> Decision:
    """Run the cascade synchronously with ``answer_for(ask) -> TierAnswer`` (replays, tests)."""
    ask = next(gen)
    while True:
        try:
            ask = gen.send(answer_for(ask))
        except StopIteration as stop:
            decision: Decision = stop.value  # a generator's return value: Any in StopIteration
            return decision
