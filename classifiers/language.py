"""The language of a prompt, by Google's Compact Language Detector 2 (``pycld2``: C++, its model
compiled into the wheel, ~0.03 ms a prompt). The encoder and every head are English-only, so the
guard sends a prompt CLD2 reliably finds in another language to the ``unfamiliar`` route.

``detect`` answers a language code (``en``, ``fr``, ...) only where CLD2 calls its answer
reliable, else ``un`` (unknown: short, mixed or no natural language at all).
"""

from __future__ import annotations

import re

import pycld2

UNKNOWN = "un"
ENGLISH = "en"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # CLD2 refuses them as "invalid UTF-8"


def detect(text: str) -> str:
    """CLD2's reliable answer, or ``un``. Characters CLD2 refuses (controls, noncharacters such as
    U+FFFE) are dropped rather than allowed to hide the language of the rest."""
    clean = _CONTROL.sub(" ", text)
    for attempt in (clean, "".join(ch for ch in clean if ch.isprintable() or ch in "\n\t")):
        try:
            reliable, _, details = pycld2.detect(attempt)
        except pycld2.error:
            continue
        return str(details[0][1]) if reliable else UNKNOWN
    return UNKNOWN


def foreign_language(code: str) -> bool:
    return code not in (ENGLISH, UNKNOWN)
