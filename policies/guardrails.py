"""The guardrails' decisions, pure: which guardrails apply to a request, what their verdicts come
to (refuse, mask, log, go on), and reversible masking (values replaced with placeholders, and the
answer's placeholders replaced with the values again, whole or as a stream's text arrives).

The checks themselves (finding PII, the jailbreak head, an operator's hook) run in the gateway
(``gateway.service.guardrails``); this module decides on what they found.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from policies.errors import GuardrailRefused
from policies.schema_guardrails import Action, GuardrailsSpec, OnError

PLACEHOLDER = re.compile(r"\[([A-Z_]+)_(\d+)\]")
_PARTIAL = re.compile(r"\[[A-Z_]*\d*$")  # a placeholder's start at the end of a stream's text so far
MAX_PLACEHOLDER = 24


def applicable(spec: GuardrailsSpec, key: str | None, team: str | None) -> tuple[str, ...]:
    """The guardrails of a request: its key's entry, else its team's, else the default (all)."""
    if key is not None and key in spec.keys:
        return tuple(spec.keys[key])
    if team is not None and team in spec.teams:
        return tuple(spec.teams[team])
    return tuple(spec.default) if spec.default is not None else tuple(spec.checks)


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    entity: str  # pii: email, phone, ...


@dataclass(frozen=True)
class Verdict:
    """One guardrail's answer on one text: a hit or not, what it found, or why it could not say."""

    guardrail: str
    kind: str
    action: Action
    on_error: OnError
    hit: bool = False
    score: float | None = None  # a head's probability
    spans: tuple[Span, ...] = ()
    reason: str | None = None
    error: str | None = None  # the check failed or passed its deadline

    @property
    def outcome(self) -> str:
        """What this verdict does to the request: refuse, mask, log, error_refuse, error_allow or pass."""
        if self.error is not None:
            return f"error_{self.on_error}"
        if not self.hit:
            return "pass"
        return self.action


def refusal(verdicts: Iterable[Verdict], stage: str) -> GuardrailRefused | None:
    """The error of the first verdict that refuses the request (a hit whose action is refuse, or a
    check that failed with ``on_error: refuse``), or None."""
    for v in verdicts:
        if v.outcome == "refuse":
            why = f": {v.reason}" if v.reason else ""
            return GuardrailRefused(
                f"the {stage} was refused by guardrail '{v.guardrail}' ({v.kind}){why}", v.guardrail
            )
        if v.outcome == "error_refuse":
            return GuardrailRefused(
                f"guardrail '{v.guardrail}' ({v.kind}) could not check the {stage}, and refuses when it cannot",
                v.guardrail,
            )
    return None


@dataclass
class Vault:
    """The values masked in one request and their placeholders (the same value, the same placeholder)."""

    values: dict[str, str] = field(default_factory=dict)  # placeholder -> value
    _by_value: dict[tuple[str, str], str] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=dict)

    def placeholder(self, entity: str, value: str) -> str:
        found = self._by_value.get((entity, value))
        if found is not None:
            return found
        n = self._counts.get(entity, 0) + 1
        self._counts[entity] = n
        tag = f"[{entity.upper()}_{n}]"
        self._by_value[(entity, value)] = tag
        self.values[tag] = value
        return tag


def resolve(spans: Sequence[Span]) -> list[Span]:
    """Spans without overlaps: the longest first, then the earliest; in text order."""
    kept: list[Span] = []
    for s in sorted(spans, key=lambda s: (-(s.end - s.start), s.start)):
        if all(s.end <= k.start or s.start >= k.end for k in kept):
            kept.append(s)
    return sorted(kept, key=lambda s: s.start)


def mask(text: str, spans: Sequence[Span], vault: Vault) -> str:
    """``text`` with each span's value replaced by its placeholder (kept in ``vault``)."""
    out, at = [], 0
    for s in resolve(spans):
        out.append(text[at : s.start])
        out.append(vault.placeholder(s.entity, text[s.start : s.end]))
        at = s.end
    out.append(text[at:])
    return "".join(out)


def redact(text: str, spans: Sequence[Span]) -> str:
    """``text`` with each span replaced by its entity's name (an answer's PII, not to be restored)."""
    out, at = [], 0
    for s in resolve(spans):
        out += [text[at : s.start], f"[{s.entity.upper()}]"]
        at = s.end
    out.append(text[at:])
    return "".join(out)


def restore(text: str, vault: Vault) -> str:
    """The placeholders of ``vault`` in ``text`` replaced by their values (others left as they are)."""
    if not vault.values:
        return text
    return PLACEHOLDER.sub(lambda m: vault.values.get(m.group(0), m.group(0)), text)


class StreamRestorer:
    """:func:`restore` over a stream's text as it arrives: a placeholder cut between two chunks is
    held back until it is whole (or plainly not one)."""

    def __init__(self, vault: Vault) -> None:
        self.vault = vault
        self._held = ""

    def feed(self, delta: str) -> str:
        text = self._held + delta
        m = _PARTIAL.search(text)
        if m is not None and len(text) - m.start() <= MAX_PLACEHOLDER:
            self._held, text = text[m.start() :], text[: m.start()]
        else:
            self._held = ""
        return restore(text, self.vault)

    def flush(self) -> str:
        text, self._held = self._held, ""
        return restore(text, self.vault)
