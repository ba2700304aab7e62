"""The policy's guardrails as served: each check made ready once at assembly (the PII finders, the
jailbreak heads, the hooks), run on a request's text or its answer's, its verdicts logged, counted
(the metrics read the counts) and kept for the console (the last ``recent`` hits and errors)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from classifiers.heads import LinearHead
from classifiers.jailbreak import SHIPPED_HEADS, jailbreak_probability, load_head
from classifiers.pii import PiiFinder
from gateway.service.guardrails.hooks import Hook
from policies.errors import NotReady, PolicyInvalid, TriageError
from policies.guardrails import Verdict, applicable
from policies.schema import Policy
from policies.schema_guardrails import GuardrailsSpec, HookGuardrail, JailbreakGuardrail, PiiGuardrail

if TYPE_CHECKING:
    from gateway.service.context import Context
    from gateway.service.encoding import Encoding

log = structlog.get_logger("triage.guardrails")
INLINE_CHARS = 4000  # a longer text's PII is looked for in a worker thread, off the event loop


@dataclass
class Tally:
    """What the guardrails did since the process started (kept across reloads): hits per guardrail
    and action, errors per guardrail and what on_error made of them, and the last hits and errors."""

    hits: Counter[tuple[str, str]] = field(default_factory=Counter)
    errors: Counter[tuple[str, str]] = field(default_factory=Counter)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=200))


class Guardrails:
    def __init__(self, spec: GuardrailsSpec, heads: dict[str, tuple[LinearHead, float]], tally: Tally) -> None:
        self.spec = spec
        self.heads = heads  # jailbreak guardrail -> its head and its cut
        self.finders = {
            n: PiiFinder(g.entities, g.regions) for n, g in spec.checks.items() if isinstance(g, PiiGuardrail)
        }
        self.hooks = {n: Hook(n, g) for n, g in spec.checks.items() if isinstance(g, HookGuardrail)}
        self.tally = tally
        if tally.recent.maxlen != spec.recent:
            tally.recent = deque(tally.recent, maxlen=spec.recent)

    @classmethod
    def build(cls, policy: Policy, base_dir: Path, previous: Guardrails | None = None) -> Guardrails | None:
        """The policy's guardrails made ready (None without a section); a head or an entry point that
        cannot be had is a PolicyInvalid naming the guardrail."""
        spec = policy.guardrails
        if spec is None:
            return None
        heads: dict[str, tuple[LinearHead, float]] = {}
        problems: list[str] = []
        for name, g in spec.checks.items():
            try:
                if isinstance(g, JailbreakGuardrail):
                    roots = (
                        [(base_dir / policy.classifier.artifacts).resolve()] if policy.classifier is not None else []
                    )
                    head = load_head([*roots, SHIPPED_HEADS], g.head)
                    heads[name] = (head, g.threshold if g.threshold is not None else float(head.meta["threshold"]))
                elif isinstance(g, HookGuardrail) and g.entry_point is not None:
                    Hook(name, g)
            except (NotReady, LookupError) as exc:
                problems.append(f"guardrails.checks.{name}: {exc.message if isinstance(exc, NotReady) else exc}")
        if problems:
            raise PolicyInvalid(problems)
        return cls(spec, heads, previous.tally if previous is not None else Tally())

    def names(self, ctx: Context) -> tuple[str, ...]:
        key = ctx.key
        return applicable(self.spec, key.name if key is not None else None, key.team if key is not None else None)

    def staged(self, names: Sequence[str], stage: str) -> list[str]:
        return [n for n in names if self.spec.checks[n].stage in (stage, "both")]

    async def check(self, name: str, stage: str, text: str, ctx: Context, encoding: Encoding | None = None) -> Verdict:
        """One guardrail's verdict on ``text``; a check that fails or passes its deadline is a verdict
        with its error (``on_error`` decides what it does)."""
        g = self.spec.checks[name]
        base = Verdict(name, g.type, g.action, g.on_error)
        try:
            if isinstance(g, PiiGuardrail):
                finder = self.finders[name]
                spans = finder.find(text) if len(text) <= INLINE_CHARS else await asyncio.to_thread(finder.find, text)
                reason = ", ".join(sorted({s.entity for s in spans})) or None
                return _hit(base, bool(spans), spans=tuple(spans), reason=reason)
            if isinstance(g, JailbreakGuardrail):
                if encoding is None:
                    raise NotReady("the jailbreak guardrail needs the policy's classifier (the encoder)")
                head, cut = self.heads[name]
                p = jailbreak_probability(head, await encoding.read(text)) if text.strip() else 0.0
                return _hit(base, p >= cut, score=round(p, 4), reason=f"P(attack) {p:.3f} >= {cut:.3f}")
            key = ctx.key
            flag = await self.hooks[name].ask(
                text, stage, key.name if key is not None else None, key.team if key is not None else None
            )
            return _hit(base, flag.flagged, reason=flag.reason)
        except (TriageError, TimeoutError, OSError, ValueError) as exc:
            error = "deadline passed" if isinstance(exc, TimeoutError) else _said(exc)
            return Verdict(name, g.type, g.action, g.on_error, error=error)

    def record(self, verdicts: Sequence[Verdict], stage: str, ctx: Context) -> None:
        """Each verdict that did something: logged (no text), counted, and kept for the console."""
        for v in verdicts:
            outcome = v.outcome
            if outcome == "pass":
                continue
            if v.error is not None:
                self.tally.errors[(v.guardrail, v.on_error)] += 1
            else:
                self.tally.hits[(v.guardrail, v.action)] += 1
            event: dict[str, Any] = {
                "request_id": ctx.request_id,
                "guardrail": v.guardrail,
                "kind": v.kind,
                "stage": stage,
                "outcome": outcome,
                "key": ctx.key.name if ctx.key is not None else None,
                "surface": ctx.surface,
            }
            if v.score is not None:
                event["score"] = v.score
            if v.reason is not None:
                event["reason"] = v.reason
            if v.error is not None:
                event["error"] = v.error
            (log.warning if v.error is not None else log.info)("guardrail", **event)
            self.tally.recent.append({"time": time.time(), **event})


def _hit(base: Verdict, hit: bool, **found: Any) -> Verdict:
    return Verdict(base.guardrail, base.kind, base.action, base.on_error, hit=hit, **found) if hit else base


def _said(exc: BaseException) -> str:
    return exc.message if isinstance(exc, TriageError) else f"{type(exc).__name__}: {exc}"[:200]
