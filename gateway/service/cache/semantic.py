"""The semantic response cache: a request of a model the policy names may get the kept answer of
a *similar* earlier request in the same context, where the fitted rule accepts it.

Each context (``policies.response_cache.context_key``: the system prompt, the earlier turns and
the fields, everything but the last user turn) has its own index of the last user turns' encoder
embeddings (``policies.semantic_cache.SemanticIndex``); an entry names the exact cache's key of
its answer, so the answer itself lives once, in the state store, under the same TTL. An entry's
*group* names what its answer means: a new answer whose embedding is within ``AGREE`` of a kept
answer of the same context joins that answer's group (the rule reads how close the nearest other
group is), else it starts its own.

Kept honest online: a share of the hits (``audit_share``) is also asked upstream, off the
request's path and at the operator's cost; a hit whose answer the fresh one does not agree with
(``AGREE``) is wrong. Once the wrong share of audited hits is over the budget with 95% confidence
(its one-sided Wilson lower bound above it, after ``MIN_AUDITS``), the rule's similarity floor is
raised by ``STEP`` and the count starts again; the upper bound is logged with each audit (what the
operator can claim of the hits served).

For a fleet, every gateway keeps its own index; entries reach the others through the state store
(``Store.feed_add`` / ``feed_read``: a Redis stream; Redis 7 as packaged has no vector index), read
every ``SYNC_S``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import orjson
import structlog

from gateway.state.stores import Store, StoreDown
from policies.schema import SemanticCacheSpec
from policies.semantic_cache import Neighbours, Rule, SemanticIndex, Vector

log = structlog.get_logger("triage.cache")
AGREE = 0.95  # two answers whose embeddings are this close say the same thing (0.9 merged HWU64 labels)
ANSWER_CHARS = 2000  # what of an answer is embedded to group it
MIN_AUDITS = 30  # audited hits before the rule may be tightened
STEP = 0.01  # how far one tightening raises the similarity floor
SYNC_S = 0.5  # how often a fleet's gateways read each other's entries
FEED = "semantic"  # the state store's feed of entries
Embed = Callable[[str], Awaitable[Vector]]


@dataclass
class _Bucket:
    """One context's entries: the questions' index, the answers' index (same entry ids), and the
    exact cache's key of each entry's answer."""

    questions: SemanticIndex
    answers: SemanticIndex
    keys: dict[int, str] = field(default_factory=dict)  # in insertion order, as the indexes evict
    known: set[str] = field(default_factory=set)

    def add(self, question: Vector, answer: Vector, group: int, key: str) -> None:
        if len(self.keys) >= self.questions.capacity:  # the indexes evict their oldest: so do the keys
            self.known.discard(self.keys.pop(next(iter(self.keys))))
        entry, same = self.questions.add(question, group), self.answers.add(answer, group)
        assert entry == same, "the two indexes add and evict in step"
        self.keys[entry] = key
        self.known.add(key)

    def remove(self, entry: int) -> None:
        self.questions.remove(entry)
        self.answers.remove(entry)
        self.known.discard(self.keys.pop(entry, ""))


@dataclass
class Found:
    key: str  # the exact cache's key of the answer to serve
    neighbours: Neighbours
    forget: Callable[[], None]  # drop the entry (its answer expired)


class SemanticCache:
    """One runtime's semantic cache (a reload starts an empty one: the policy's version is in
    every key, so nothing kept before would be served anyway)."""

    def __init__(self, spec: SemanticCacheSpec, embed: Embed, dim: int, version: str, store: Store) -> None:
        self.spec, self.embed, self.dim, self.version, self.store = spec, embed, dim, version, store
        self.rule = Rule.from_dict(spec.rule)
        self.models = frozenset(spec.models)
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()  # least recently used first
        self._entries = 0
        self.audited = self.wrong = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._feed_after = "0"  # the feed: from its start (entries whose answers expired are dropped when found)
        self._synced = 0.0

    def find(self, ctx: str, question: Vector) -> Found | None:
        """The entry whose answer the rule accepts for ``question`` in context ``ctx``, or None."""
        bucket = self._buckets.get(ctx)
        if bucket is None:
            return None
        self._buckets.move_to_end(ctx)
        n = bucket.questions.nearest(question)
        if n is None or not self.rule.accepts(n):
            return None
        return Found(bucket.keys[n.entry], n, lambda: bucket.remove(n.entry))

    def add(self, ctx: str, question: Vector, answer: Vector, key: str, group: int | None = None) -> int:
        """Keep an entry: its answer joins the group of an answer it agrees with, else a new one
        (``group``: the one another gateway gave it). Returns its group."""
        bucket = self._buckets.get(ctx)
        if bucket is None:
            cap = self.spec.capacity
            bucket = self._buckets[ctx] = _Bucket(SemanticIndex(self.dim, cap), SemanticIndex(self.dim, cap))
        self._buckets.move_to_end(ctx)
        if group is None:
            close = bucket.answers.nearest(answer)
            group = close.group if close is not None and close.similarity >= AGREE else secrets.randbits(62)
        before = len(bucket.questions)
        bucket.add(question, answer, group, key)
        self._entries += len(bucket.questions) - before
        while self._entries > self.spec.capacity and len(self._buckets) > 1:  # the least recent context leaves
            _, old = self._buckets.popitem(last=False)
            self._entries -= len(old.questions)
        return group

    async def keep(self, ctx: str, question: Vector, key: str, answer_text: str) -> None:
        """Embed the answer, keep the entry, and tell the fleet (the state store's feed)."""
        answer = await self.embed(answer_text[:ANSWER_CHARS])
        group = self.add(ctx, question, answer, key)
        entry = {"v": self.version, "ctx": ctx, "key": key, "group": group}
        raw = orjson.dumps(entry) + b"\n" + _pack(question) + _pack(answer)
        try:
            await self.store.feed_add(FEED, raw)
        except StoreDown as exc:
            log.warning("semantic_cache_feed_unavailable", error=exc.message)

    async def sync(self, now: float) -> None:
        """Entries the fleet's other gateways kept since the last read (at most every ``SYNC_S``)."""
        if now - self._synced < SYNC_S:
            return
        self._synced = now
        try:
            after, items = await self.store.feed_read(FEED, self._feed_after)
        except StoreDown as exc:
            log.warning("semantic_cache_feed_unavailable", error=exc.message)
            return
        self._feed_after = after
        for raw in items:
            head, _, vectors = raw.partition(b"\n")
            try:
                entry = orjson.loads(head)
                ctx, key, group = str(entry["ctx"]), str(entry["key"]), int(entry["group"])
                q, a = _unpack(vectors[: len(vectors) // 2]), _unpack(vectors[len(vectors) // 2 :])
            except (orjson.JSONDecodeError, ValueError, KeyError, TypeError):
                log.warning("semantic_cache_feed_unreadable")
                continue
            if entry.get("v") != self.version or q.shape != (self.dim,) or a.shape != (self.dim,):
                continue  # another policy's (a gateway not yet reloaded), or another encoder's
            bucket = self._buckets.get(ctx)
            if bucket is not None and key in bucket.known:
                continue  # this gateway's own, or one read before
            self.add(ctx, q, a, key, group)

    def later(self, work: Awaitable[None]) -> None:
        """Run ``work`` off the request's path (kept entries, audits)."""

        async def run() -> None:
            try:
                await work
            except Exception as exc:
                log.warning("semantic_cache_background_failed", error=repr(exc)[:300])

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def audit_due(self) -> bool:
        return self.spec.audit_share > 0 and secrets.randbelow(1_000_000) < self.spec.audit_share * 1_000_000

    def audited_hit(self, right: bool) -> None:
        """Count an audited hit; tighten the rule once its wrong share is over the budget for sure."""
        self.audited += 1
        self.wrong += not right
        low, high = bounds(self.wrong, self.audited)
        log.info("semantic_cache_audit", right=right, audited=self.audited, wrong=self.wrong, upper=round(high, 4))
        if self.audited >= MIN_AUDITS and low > self.spec.false_hit_budget and self.rule.similarity < 1.0:
            floor = min(1.0, self.rule.similarity + STEP)
            log.warning("semantic_cache_tightened", similarity=floor, wrong=self.wrong, audited=self.audited)
            self.rule = dataclasses.replace(self.rule, similarity=floor)
            self.audited = self.wrong = 0  # the tightened rule is judged on its own hits

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)


def bounds(wrong: int, n: int, z: float = 1.645) -> tuple[float, float]:
    """The one-sided 95% Wilson bounds of a share ``wrong / n`` ((0, 1) when nothing was counted)."""
    if n == 0:
        return 0.0, 1.0
    p = wrong / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def agree(a: Vector, b: Vector) -> bool:
    """Two answers' embeddings say the same thing."""
    return float(np.dot(a, b)) >= AGREE


def _pack(v: Vector) -> bytes:
    return np.asarray(v, dtype=np.float32).tobytes()


def _unpack(raw: bytes) -> Vector:
    if len(raw) % 4:
        raise ValueError("not float32 bytes")
    return np.frombuffer(raw, dtype=np.float32).copy()
