"""The semantic response cache's index and its hit rule. Pure: numpy and the standard library.

One :class:`SemanticIndex` holds one context bucket's cached entries: L2-normalised float32
vectors (the encoder's embedding of a request's last user turn) in a preallocated matrix, each
with a ``group`` (an opaque int naming the entry's *answer*: entries whose answers mean the same
thing share a group). A lookup is one matrix-vector product (cosine = dot) and reads what the
rule needs into :class:`Neighbours`: the nearest entry, its similarity and group, ``other`` (the
best similarity among entries of another group) and how many of the ``k`` nearest share the
nearest's group. A :class:`Rule` (fitted offline, :mod:`eval.cache_fit`) says whether the nearest
entry's answer is served ("a hit").

Rule kinds (each monotone: a higher similarity never turns a hit into a miss, a higher ``other``
never turns a miss into a hit):

- ``global``: similarity >= ``similarity`` (the baseline);
- ``margin``: similarity >= ``similarity`` and similarity - other >= ``margin`` (the nearest
  group is clearly closer than any other group);
- ``vote``: the margin rule, and at least ``agree`` of the ``k`` nearest share the nearest's group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]
KINDS = ("global", "margin", "vote")
NEIGHBOURS = 8  # the k nearest a lookup reads (``Neighbours.agree`` counts among them)
NEAR = (0.1, 0.3, 0.6, 4.0)  # a lookup looks for the k nearest within these of the best similarity


@dataclass(frozen=True)
class Neighbours:
    """What a lookup found, read from the index alone (nothing of the new request but its vector)."""

    entry: int  # the nearest entry's id
    similarity: float  # its cosine with the request
    group: int  # its group
    other: float  # the highest similarity among entries of another group; -1.0 when none
    agree: int  # how many of the k nearest (the nearest included) share its group
    k: int  # how many nearest were read: min(NEIGHBOURS, size)
    size: int  # entries in the index

    @property
    def margin(self) -> float:
        return self.similarity - self.other


@dataclass(frozen=True)
class Rule:
    """A fitted hit rule; ``as_dict`` holds only the fields its ``kind`` reads."""

    kind: str = "global"
    similarity: float = 1.0
    margin: float = 0.0
    agree: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown semantic cache rule kind {self.kind!r} (one of {', '.join(KINDS)})")

    def accepts(self, n: Neighbours) -> bool:
        if n.similarity < self.similarity:
            return False
        if self.kind == "global":
            return True
        if n.similarity - n.other < self.margin:
            return False
        return self.kind == "margin" or n.agree >= self.agree

    def as_dict(self) -> dict[str, float | int | str]:
        d: dict[str, float | int | str] = {"kind": self.kind, "similarity": round(self.similarity, 6)}
        if self.kind != "global":
            d["margin"] = round(self.margin, 6)
        if self.kind == "vote":
            d["agree"] = self.agree
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Rule:
        known = {f for f in asdict(cls()) if f in d}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown semantic cache rule fields: {', '.join(sorted(unknown))}")
        kind = str(d.get("kind", "global"))
        sim, margin, agree = d.get("similarity", 1.0), d.get("margin", 0.0), d.get("agree", 1)
        if not isinstance(sim, int | float) or not isinstance(margin, int | float) or not isinstance(agree, int):
            raise ValueError("semantic cache rule: similarity and margin are numbers, agree an integer")
        return cls(kind=kind, similarity=float(sim), margin=float(margin), agree=int(agree))


class SemanticIndex:
    """One context bucket's entries; past ``capacity`` the oldest entry is evicted."""

    def __init__(self, dim: int, capacity: int, k: int = NEIGHBOURS) -> None:
        if capacity < 1 or dim < 1 or k < 1:
            raise ValueError("dim, capacity and k must be positive")
        self.dim, self.capacity, self.k = dim, capacity, k
        rows = min(capacity, 16)  # grown by doubling up to capacity: a context with few entries holds little
        self._vectors = np.zeros((rows, dim), dtype=np.float32)
        self._groups = np.zeros(rows, dtype=np.int64)
        self._ids = np.full(rows, -1, dtype=np.int64)  # the entry id in each slot, -1 when free
        self._slot: dict[int, int] = {}  # entry id -> slot, in insertion order (the oldest first)
        self._free: list[int] = []  # freed slots below _high
        self._high = 0  # slots ever used: a lookup reads [:_high]
        self._next = 0

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._slot

    def _grow(self) -> None:
        rows = min(self.capacity, 2 * len(self._ids))
        extra = rows - len(self._ids)
        self._vectors = np.concatenate([self._vectors, np.zeros((extra, self.dim), dtype=np.float32)])
        self._groups = np.concatenate([self._groups, np.zeros(extra, dtype=np.int64)])
        self._ids = np.concatenate([self._ids, np.full(extra, -1, dtype=np.int64)])

    def add(self, vector: Vector, group: int) -> int:
        """Insert an entry; returns its id."""
        if len(self._slot) >= self.capacity:
            self.remove(next(iter(self._slot)))
        if self._free:
            slot = self._free.pop()
        else:
            if self._high == len(self._ids):
                self._grow()
            slot, self._high = self._high, self._high + 1
        entry, self._next = self._next, self._next + 1
        self._vectors[slot] = vector
        self._groups[slot] = group
        self._ids[slot] = entry
        self._slot[entry] = slot
        return entry

    def remove(self, entry_id: int) -> None:
        slot = self._slot.pop(entry_id, None)
        if slot is None:
            return
        self._ids[slot] = -1
        self._vectors[slot] = 0.0
        if slot == self._high - 1:
            self._high -= 1
        else:
            self._free.append(slot)

    def group(self, entry_id: int) -> int:
        return int(self._groups[self._slot[entry_id]])

    def nearest(self, vector: Vector) -> Neighbours | None:
        """The nearest entry and its neighbourhood; None when the index is empty."""
        size = len(self._slot)
        if size == 0:
            return None
        n = self._high
        sims = self._vectors[:n] @ vector
        if size < n:  # freed slots are never found
            sims[self._ids[:n] < 0] = -2.0
        k = min(self.k, size)
        best_sim = sims.max()
        for width in NEAR:  # the k nearest are among those within ``width`` of the best when k of them are
            near = np.flatnonzero(sims >= best_sim - width)
            if len(near) >= k:
                break
        top = near[np.argpartition(sims[near], len(near) - k)[len(near) - k :]] if len(near) > k else near
        top = top[np.argsort(-sims[top], kind="stable")]
        best = int(top[0])
        group = int(self._groups[best])
        same = self._groups[top] == group
        if not same.all():  # the best of another group is among the k nearest
            other = float(sims[top[int(np.argmin(same))]])
        else:
            masked = np.where(self._groups[:n] != group, sims, -2.0)
            other = max(float(masked.max()), -1.0)
        return Neighbours(
            entry=int(self._ids[best]),
            similarity=float(sims[best]),
            group=group,
            other=other,
            agree=int(same.sum()),
            k=k,
            size=size,
        )
