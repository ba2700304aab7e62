"""The live-traffic quality store's contract: :class:`QualityStore`, written once; ``sqlite.py``
(the embedded default) and ``pg.py`` (a fleet's) implement it, and ``tests/state/test_quality_store.py``
holds both to the same assertions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from gateway.state.quality.model import Pair, Record, SliceCounts


class QualityStore(Protocol):
    """Records, shadow pairs and feedback (see the module's docstring); :class:`SqliteQuality` and
    ``gateway.state.quality_pg.PgQuality`` are its two engines."""

    where: str  # the store, for messages: never a password

    async def close(self) -> None: ...

    async def record(self, records: Sequence[Record]) -> None:
        """Keep ``records``, in one transaction; a request_id already recorded is left as it was."""
        ...

    async def pair(self, pair: Pair) -> None:
        """Keep a shadow pair; a request_id that has one already keeps it (the second is ignored)."""
        ...

    async def feedback(
        self, request_id: str, owner: str | None, at: float, verdict: str | None, score: float | None
    ) -> bool:
        """Feedback on a record, replacing any earlier; False when ``owner`` has no record of that id
        (an ``owner`` of None: when there is none at all). ``verdict`` is "right", "wrong" or None,
        ``score`` a float or None; the caller checks them."""
        ...

    async def counts(self, since: float) -> list[SliceCounts]:
        """The records at or after ``since``, summed by slice, ordered by model, kind, answered_by, slice."""
        ...

    async def export(self, since: float, limit: int) -> list[dict[str, Any]]:
        """The records at or after ``since`` that have a pair or feedback, newest first, at most
        ``limit``: every :class:`Record` field, and ``kept``, ``top_answer``, ``agree`` (None
        without a pair), ``verdict``, ``score``."""
        ...

    async def prune(self, before: float) -> int:
        """Forget the records older than ``before``, with their pairs and feedback (and pairs and
        feedback older than it whose record was never written); how many records."""
        ...
