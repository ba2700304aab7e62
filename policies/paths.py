"""Where triage keeps what it makes: the cache folder (joined GGUF files, encoder exports,
embeddings, the Batch API's default stores), ``$TRIAGE_CACHE_DIR`` or ``~/.cache/triage``.

The ground floor: it imports nothing of triage, reads the environment only when called, and
touches no file. The engines (``backends/``) and the encoder (``classifiers/``) both stand on it,
so neither imports the other for it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TRIAGE_CACHE_DIR") or Path.home() / ".cache" / "triage")
