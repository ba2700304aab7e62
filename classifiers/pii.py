"""Personal data in text: where each value is, by kind (the ``pii`` guardrail's finder).

Candidates are found by pattern and kept only where a maintained library says they are what they
look like: phone numbers by Google's libphonenumber (``phonenumbers``: its matcher, numbers valid
for one of the policy's regions or written with a country code); card numbers by the Luhn checksum
and IBANs by their ISO 13616 check digits and each country's length and format (``python-stdnum``);
national ids by their own rules and checksums in ``python-stdnum`` (US social security numbers, UK
NHS numbers, French NIR), written as people write them; e-mail and IP addresses by pattern (and
``ipaddress``). Names and street addresses need a model (an NER tagger): none installs from the
package registries here without a download from a model hub, so they are not found.

Pure computation, no I/O; a few tens of microseconds on a short prompt without digits or ``@``.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

import phonenumbers
from stdnum import iban, luhn
from stdnum.fr import nir
from stdnum.gb import nhs
from stdnum.us import ssn

from policies.guardrails import Span
from policies.schema_guardrails import PII_ENTITIES

_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63})*\.[A-Za-z]{2,24}\b")
_CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){11,18}\d(?![\d-])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?:[ ]?[A-Z0-9]){11,30}\b")
_SSN = re.compile(r"(?<![\d-])\d{3}([- ])\d{2}\1\d{4}(?![\d-])")
_NHS = re.compile(r"(?<![\d-])\d{3}( ?)\d{3}\1\d{4}(?![\d-])")
_PHONE = re.compile(
    r"(?<![\w+])(?:\+|\(\+?)?\d(?:(?:[-.\s]|\) ?| ?\()?\d){6,16}(?:\s?(?:x|ext\.?)\s?\d{1,6})?(?![\w-])"
)
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}[./-]\d{1,2}[./-]\d{2,4}")
_NIR = re.compile(r"(?<![\d])[12][ ]?\d{2}[ ]?\d{2}[ ]?(?:\d{2}|2[AB])[ ]?\d{3}[ ]?\d{3}[ ]?\d{2}(?!\d)")
_IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_DIGITS = re.compile(r"\d")
CARD_PREFIXES = ("1800", "2131", "2", "3", "4", "5", "6")  # the card networks' issuer ranges (ISO/IEC 7812)
MAESTRO = ("5018", "5020", "5038", "6304", "6759", "6761", "6763")  # the only 12-digit card numbers


class PiiFinder:
    """Finds the ``entities`` of a policy's ``pii`` guardrail; ``regions``: whose phone numbers
    (ISO 3166 codes, as libphonenumber names them) and national ids are looked for."""

    def __init__(self, entities: Sequence[str] = PII_ENTITIES, regions: Sequence[str] = ("US",)) -> None:
        unknown = set(entities) - set(PII_ENTITIES)
        if unknown:
            raise ValueError(f"unknown PII entities: {', '.join(sorted(unknown))}")
        self.entities = frozenset(entities)
        self.regions = tuple(r.upper() for r in regions)

    def find(self, text: str) -> list[Span]:
        """Every value found, in text order (overlaps are resolved when masking)."""
        spans: list[Span] = []
        if "email" in self.entities and "@" in text:
            spans += [Span(m.start(), m.end(), "email") for m in _EMAIL.finditer(text)]
        if "ip_address" in self.entities:
            spans += _ips(text)
        if "iban" in self.entities:
            spans += [Span(m.start(), m.end(), "iban") for m in _IBAN.finditer(text) if iban.is_valid(m.group())]
        if len(_DIGITS.findall(text)) >= 7:  # every numbered kind has seven digits or more
            spans += self._numbers(text, spans)
        return sorted(set(spans), key=lambda s: (s.start, s.end))

    def _numbers(self, text: str, found: list[Span]) -> list[Span]:
        out: list[Span] = []
        if "credit_card" in self.entities:
            for m in _CARD.finditer(text):
                digits = re.sub(r"\D", "", m.group())
                shortest = 12 if digits.startswith(MAESTRO) else 13
                if shortest <= len(digits) <= 19 and digits.startswith(CARD_PREFIXES) and luhn.is_valid(digits):
                    out.append(Span(m.start(), m.end(), "credit_card"))
        if "national_id" in self.entities:  # before phones: their formats are stricter
            out += [s for s in self._national_ids(text) if not _overlaps(s.start, s.end, [*found, *out])]
        if "phone" in self.entities:
            out += self._phones(text, [*found, *out])
        return out

    def _phones(self, text: str, found: list[Span]) -> list[Span]:
        """Phone-shaped runs that libphonenumber calls valid: with their country code, or in one of
        the regions (its matcher over the whole text took 4-10 ms a region on a prompt full of digits)."""
        out = []
        for m in _PHONE.finditer(text):
            raw = m.group()
            if _overlaps(m.start(), m.end(), found) or len(_DIGITS.findall(raw)) < 7 or _DATE.match(raw):
                continue
            for region in (None,) if raw.startswith(("+", "(+")) else self.regions:
                try:
                    number = phonenumbers.parse(raw, region)
                except phonenumbers.NumberParseException:
                    continue
                if phonenumbers.is_valid_number(number):
                    out.append(Span(m.start(), m.end(), "phone"))
                    break
        return out

    def _national_ids(self, text: str) -> list[Span]:
        out: list[Span] = []
        if "US" in self.regions:
            out += [Span(m.start(), m.end(), "national_id") for m in _SSN.finditer(text) if ssn.is_valid(m.group())]
        if "GB" in self.regions:
            out += [
                Span(m.start(), m.end(), "national_id")
                for m in _NHS.finditer(text)
                if m.group(1) and nhs.is_valid(m.group())
            ]
        if "FR" in self.regions:
            out += [Span(m.start(), m.end(), "national_id") for m in _NIR.finditer(text) if nir.is_valid(m.group())]
        return out


def _overlaps(start: int, end: int, spans: list[Span]) -> bool:
    return any(s.start < end and start < s.end for s in spans)


def _ips(text: str) -> list[Span]:
    out = []
    for pattern in (_IPV4, _IPV6) if ":" in text else (_IPV4,):
        for m in pattern.finditer(text):
            try:
                ipaddress.ip_address(m.group())
            except ValueError:
                continue
            out.append(Span(m.start(), m.end(), "ip_address"))
    return out
