"""The policy file's ``guardrails`` section: named checks run on a request's text before it is
routed (``input``) and on its answer (``output``, streamed answers too), and which of them apply to
whom. The decisions are pure (:mod:`policies.guardrails`); the checks run in the gateway.

Kinds:

- ``pii``: personal data found by maintained libraries (``phonenumbers`` for phone numbers,
  ``python-stdnum`` for the checksums of card numbers, IBANs and national ids; e-mail and IP
  addresses by pattern); ``mask`` replaces each value with a placeholder (``[EMAIL_1]``) and, with
  ``restore``, the answer gets the original values back in place of the placeholders;
- ``jailbreak``: a head on the encoder's embedding of the last user turn (the one the router
  reads: no second model on the request's path), cut at its fitted threshold (a false-positive
  rate on benign prompts) unless ``threshold`` says otherwise;
- ``hook``: an operator's own check, an HTTP endpoint (``url``) or a Python entry point registered
  by an installed package in the ``triage.guardrails`` group (``entry_point``), with a deadline.

Each has an ``action`` on a hit (``refuse``: a 400 naming it; ``mask``; ``log``: the request goes
on) and ``on_error`` (``refuse`` or ``allow``) for a check that fails or passes its deadline.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from policies.strict import Strict

Action = Literal["refuse", "mask", "log"]
OnError = Literal["refuse", "allow"]
Stage = Literal["input", "output", "both"]
PiiEntity = Literal["email", "phone", "credit_card", "iban", "national_id", "ip_address"]
PII_ENTITIES: tuple[PiiEntity, ...] = ("email", "phone", "credit_card", "iban", "national_id", "ip_address")
GUARDRAIL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class _Guardrail(Strict):
    action: Action = Field("refuse", description="on a hit: refuse (400 naming it), mask, or log only")
    stage: Stage = Field("input", description="the request's text (input), the answer (output), or both")
    on_error: OnError = Field("refuse", description="a check that fails or passes its deadline: refuse or allow")


class PiiGuardrail(_Guardrail):
    type: Literal["pii"]
    entities: list[PiiEntity] = Field(default_factory=lambda: list(PII_ENTITIES), min_length=1)
    regions: list[str] = Field(
        default_factory=lambda: ["US", "GB", "DE", "FR"],
        min_length=1,
        description="regions (ISO 3166) whose phone numbers and national ids are looked for",
    )
    restore: bool = Field(True, description="mask: the answer gets the original values back")
    action: Action = "mask"

    @model_validator(mode="after")
    def _restore_masks(self) -> PiiGuardrail:
        if self.action != "mask" and "restore" in self.model_fields_set and self.restore:
            raise ValueError("restore is for action: mask")
        return self


class JailbreakGuardrail(_Guardrail):
    type: Literal["jailbreak"]
    head: str = Field("jailbreak", description="the head's name: in the classifier's artifacts, else the shipped one")
    threshold: float | None = Field(None, gt=0, lt=1, description="P(attack) cut (unset: the head's fitted one)")

    @model_validator(mode="after")
    def _no_mask(self) -> JailbreakGuardrail:
        if self.action == "mask":
            raise ValueError("a jailbreak guardrail refuses or logs; it has nothing to mask")
        if self.stage != "input":
            raise ValueError("a jailbreak guardrail reads the request (stage: input)")
        return self


class HookGuardrail(_Guardrail):
    type: Literal["hook"]
    url: str | None = Field(None, description="POST {guardrail, stage, text, key, team}; answer {flagged, reason}")
    entry_point: str | None = Field(None, description="an entry point's name in the triage.guardrails group")
    timeout_s: float = Field(0.5, gt=0, le=30, description="the deadline; past it, on_error decides")
    headers: dict[str, str] = Field(default_factory=dict, description="sent with each call (values may be env:NAME)")

    @model_validator(mode="after")
    def _one_target(self) -> HookGuardrail:
        if (self.url is None) == (self.entry_point is None):
            raise ValueError("a hook has exactly one of url and entry_point")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError("a hook's url is http:// or https://")
        if self.action == "mask":
            raise ValueError("a hook refuses or logs; it has nothing to mask")
        return self


Guardrail = Annotated[PiiGuardrail | JailbreakGuardrail | HookGuardrail, Field(discriminator="type")]


class GuardrailsSpec(Strict):
    """Named guardrails, and which of them apply to a request: its key's entry in ``keys``, else
    its team's in ``teams``, else ``default`` (unset: every guardrail)."""

    checks: dict[str, Guardrail] = Field(min_length=1, description="name -> guardrail")
    default: list[str] | None = Field(None, description="the guardrails of a request no entry names (unset: all)")
    keys: dict[str, list[str]] = Field(default_factory=dict, description="key name -> its guardrails")
    teams: dict[str, list[str]] = Field(default_factory=dict, description="team name -> its guardrails")
    hold_chars: int = Field(
        64, ge=8, le=4096, description="a stream's text held back for an output check (a value split across chunks)"
    )
    recent: int = Field(200, ge=0, le=10_000, description="guardrail hits kept for the console")
