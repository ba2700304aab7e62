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
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # CLD2 refuses them as "invalid UTF-8"


def detect(text: str) -> str:
    try:
        reliable, _, details = pycld2.detect(_CONTROL.sub(" ", text))
    except pycld2.error:  # text it cannot read is no language it knows
        return UNKNOWN
    return str(details[0][1]) if reliable else UNKNOWN


def foreign_language(code: str) -> bool:
    return code not in (ENGLISH, UNKNOWN)
