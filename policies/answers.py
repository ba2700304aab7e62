"""Reading a generated answer: the option a model named, and the final number of a worked answer.
Pure: no I/O.

Numbers (GSM8K and the like): the number after the last ``####``, ``answer is`` or ``Answer:``
marker when there is one, else the last number in the text. Thousands separators, a leading
currency sign and a trailing period are dropped; ``12.0`` reads as ``12``. Two numbers are the
same answer when they differ by at most 1e-6 (relative to the larger, for big numbers).
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Iterable, Mapping, Sequence

_NUMBER = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\$?\s?\.\d+")
_MARKER = re.compile(r"(?:####|answer is|answer:)", re.IGNORECASE)
_STRIP = string.whitespace + string.punctuation.replace("-", "")


def canonical_number(raw: str) -> str | None:
    text = raw.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def extract_number(text: str) -> str | None:
    """The final number of a worked answer, canonical, or None when the text holds none."""
    markers = list(_MARKER.finditer(text))
    if markers:
        tail = text[markers[-1].end() :]
        first = _NUMBER.search(tail)
        if first is not None:
            return canonical_number(first.group())
    found = _NUMBER.findall(text)
    return canonical_number(found[-1]) if found else None


def same_number(a: str, b: str) -> bool:
    x, y = canonical_number(a), canonical_number(b)
    if x is None or y is None:
        return False
    fx, fy = float(x), float(y)
    return abs(fx - fy) <= 1e-6 * max(1.0, abs(fx), abs(fy))


def labels_for(qtype: str, options: Sequence[str]) -> tuple[str, ...]:
    """What a generating model is asked to answer with: letters for choices (numbers past 26),
    the words for yes/no, the values of a scale."""
    if qtype != "choice":
        return tuple(options)
    if len(options) <= 26:
        return tuple(string.ascii_uppercase[: len(options)])
    return tuple(str(i + 1) for i in range(len(options)))


def _norm(token: str, case_sensitive: bool) -> str:
    t = token.strip(_STRIP)
    return t if case_sensitive else t.lower()


def label_in_text(text: str, labels: Sequence[str]) -> int | None:
    """The index of the first label the text names as a whole word, or None."""
    case_sensitive = all(len(label) == 1 and label.isupper() for label in labels)
    index = {(label if case_sensitive else label.lower()): i for i, label in enumerate(labels)}
    for word in re.findall(r"[A-Za-z0-9-]+", text):
        key = word if case_sensitive else word.lower()
        if key in index:
            return index[key]
    return None


def label_logprobs(content: Sequence[Mapping[str, object]], labels: Sequence[str]) -> list[float] | None:
    """Log-scores per label from an OpenAI ``logprobs.content`` list: the top_logprobs of the
    first token that is not whitespace or punctuation. Labels missing from the top list share
    what mass is left. None when that position names no label at all."""
    case_sensitive = all(len(label) == 1 and label.isupper() for label in labels)
    index = {(label if case_sensitive else label.lower()): i for i, label in enumerate(labels)}
    for position in content:
        token = position.get("token")
        if not isinstance(token, str) or not _norm(token, True):
            continue
        mass = [0.0] * len(labels)
        alts = position.get("top_logprobs") or [{"token": token, "logprob": position.get("logprob")}]
        if not isinstance(alts, Iterable):  # malformed: no alternatives to read
            alts = ()
        for alt in alts:
            if not isinstance(alt, Mapping):
                continue
            key, lp = _norm(str(alt.get("token", "")), case_sensitive), alt.get("logprob")
            if key in index and isinstance(lp, int | float):
                mass[index[key]] += math.exp(lp)
        if not any(mass):
            return None
        missing = [i for i, m in enumerate(mass) if m == 0.0]
        rest = max(1.0 - sum(mass), 1e-6) / max(len(missing), 1)
        return [math.log(m if m > 0 else rest) for m in mass]
    return None


def assumed_scores(n: int, index: int, confidence: float) -> list[float]:
    """Log-scores for an answer that came without probabilities: ``confidence`` on it, the rest shared."""
    confidence = min(max(confidence, 1e-6), 1 - 1e-6)
    other = (1 - confidence) / max(n - 1, 1)
    return [math.log(confidence if i == index else other) for i in range(n)]
