"""Layout features of a prompt: whether it lists lettered options, read from its text, not its embedding.

A mean-pooled sentence embedding hears a prompt's topic far louder than its shape: two long
how-to options (PIQA) or four story endings (HellaSwag) under ``A.``/``B.`` read as an open
request about the topic. The question-type head therefore reads, beside the embedding, how many
option letters the prompt lists in order (``A.``, ``A)``, ``A:``, ``(A)`` or ``(a)``, at the start
or after a space): the run A, B, C ... as a share of ten, and whether it is at least two.

The head is fitted with the shaped choice rows twice, once with these features and once with them
zeroed (as a layout this module does not recognise would give), so that the lack of a run is not
taken as evidence against a choice: numbered options, bullets or ``Option 1:`` are left to the
embedding.
Pure; a few microseconds per prompt.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

NAME = "layout-v1"  # what a head's ``meta["layout"]`` names: bump when the features change
WIDTH = 2
# (a) (A) A. A) A: after a space or at the start. Lowercase letters count only as (a): in the dev rows
# a) and a. at a line start are sub-items of open requests ("a) Company X ... b) Company Y ..."), never options
_MARKERS = re.compile(r"(?:^|(?<=\s))(?:\(([A-Ja-j])\)|([A-J])[.):])(?=\s)")
_MAX_RUN = 10
WINDOW = 8192  # characters read from each end of a longer prompt (the encoder, too, keeps head and tail)


def option_run(text: str | bytes) -> int:
    """How many option letters A, B, C ... the text lists in that order (gaps between them allowed)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if len(text) > 2 * WINDOW:  # bounded work on huge prompts: the regex runs on the request path
        text = f"{text[:WINDOW]}\n{text[-WINDOW:]}"
    want, n = "A", 0
    for m in _MARKERS.finditer(text):
        letter = next(g for g in m.groups() if g).upper()
        if letter == want:
            n += 1
            want = chr(ord(want) + 1)
            if n == _MAX_RUN:
                break
    return n


def features(texts: Sequence[str | bytes]) -> np.ndarray:
    """``(len(texts), WIDTH)``: the run of option letters as a share of ten, and whether it is at least two."""
    runs = np.array([option_run(t) for t in texts], dtype=np.float32).reshape(len(texts))
    return (
        np.stack([runs / _MAX_RUN, (runs >= 2).astype(np.float32)], axis=1)
        if len(texts)
        else np.zeros((0, WIDTH), dtype=np.float32)
    )


def reads_layout(meta: dict[str, object]) -> bool:
    """Whether a head with this ``meta`` reads the layout features after the embedding."""
    return bool(meta.get("layout"))


def beside(x: np.ndarray, texts: Sequence[str | bytes]) -> np.ndarray:
    """The embeddings ``x`` with the texts' layout features after them: what a layout head reads."""
    return np.hstack([np.asarray(x, dtype=np.float32), features(texts)])


def fit_rows(
    x: np.ndarray, texts: Sequence[str], labels: Sequence[str], ids: Sequence[str], synthetic: Sequence[bool]
) -> tuple[np.ndarray, list[str], list[str], list[bool]]:
    """A layout head's fit rows: every row with its features, and the ``synthetic`` (shaped) rows once
    more with them zeroed, so that a layout the features miss is not read as no options at all."""
    full = beside(x, texts)
    again = [i for i, s in enumerate(synthetic) if s]
    blank = np.hstack([x[again], np.zeros((len(again), WIDTH), dtype=np.float32)])
    return (
        np.vstack([full, blank]),
        [*labels, *(labels[i] for i in again)],
        [*ids, *(f"{ids[i]}#no-layout" for i in again)],
        [*synthetic, *([True] * len(again))],
    )
