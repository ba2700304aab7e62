"""The response cache in the request path: an open request's whole answer kept in the state store
(memory, or Redis shared by a fleet) and served again to the same request, exactly, or (for the
models the policy names) to a similar one in the same context (``gateway.service.cache.semantic``).

A hit asks no engine: its answer is replayed as the request asked for it (JSON, or a stream in
the surface's own events), charged ``hit_charge`` of its price (in spend as ``cache:MODEL``). What
the cache did is said in ``x-triage-cache: hit | miss | bypass``. The rules (what is keyed, when a
request may be answered from the cache, a stream assembled into the answer it is kept as) are
``policies.response_cache``; a store that fails, or an entry that does not read, is a miss, logged.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import structlog

from backends.base import Body, ChunkStream, Completion, Kind
from gateway.service.cache.semantic import SemanticCache
from gateway.service.context import Context
from gateway.service.dispatch import Served
from gateway.service.job import Note  # what the cache did: the outcome's vocabulary, made here
from gateway.service.runtime import Runtime
from gateway.state.stores import StoreDown
from policies import response_cache as rules
from policies import spend
from policies.schema import ResponseCacheSpec
from policies.semantic_cache import Vector

log = structlog.get_logger("triage.cache")
BACKEND = "cache"
__all__ = ["BACKEND", "Lookup", "Note", "answer_text", "begin", "charge", "replayed"]


@dataclass
class Lookup:
    """One request's pass through the cache: looked up before it is served, kept after."""

    rt: Runtime
    spec: ResponseCacheSpec
    kind: Kind
    key: str
    read: bool
    write: bool
    note: Note
    semantic: SemanticCache | None = None  # where the requested model may get a similar request's answer
    context: str = ""  # the semantic cache's bucket (everything but the last user turn)
    text: str = ""  # the last user turn
    vector: Vector | None = None  # its embedding, once made

    async def find(self) -> Served | None:
        """The kept answer as served: this request's, else (semantic) a similar one's; or None (a
        miss, or a request that may not read the cache)."""
        if not self.read:
            return None
        t0 = time.perf_counter()
        served = await self._find()
        self.note.lookup_ms = round((time.perf_counter() - t0) * 1000, 3)
        return served

    async def _find(self) -> Served | None:
        served = await self._get(self.key, "exact")
        if served is not None or self.semantic is None:
            return served
        await self.semantic.sync(time.monotonic())
        t1 = time.perf_counter()
        self.vector = await self.semantic.embed(self.text)
        embed_ms = round((time.perf_counter() - t1) * 1000, 3)
        self.note.embed_ms = embed_ms
        found = self.semantic.find(self.context, self.vector)
        if found is None:
            return None
        served = await self._get(found.key, f"semantic {found.neighbours.similarity:.4f}")
        if served is None:
            found.forget()  # its answer expired, or was evicted
        else:
            self.note.embed_ms = embed_ms  # the hit's note is a new one
        return served

    async def _get(self, key: str, match: str) -> Served | None:
        try:
            raw = await self.rt.store.cache_get(key)
        except StoreDown as exc:
            log.warning("response_cache_unavailable", error=exc.message)
            return None
        if raw is None:
            return None
        served = self._read(raw, match)
        if served is None:
            log.warning("response_cache_unreadable", key=key[:20])
        return served

    def _read(self, raw: bytes, match: str = "exact") -> Served | None:
        try:
            entry = orjson.loads(raw)
            model, body, price = entry["model"], entry["body"], float(entry.get("price") or 0.0)
            if not (isinstance(model, str) and isinstance(body, dict) and isinstance(body.get("choices"), list)):
                return None
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None
        charged = price * self.spec.hit_charge
        self.note = Note("hit", match=match, price=price, charged=charged)
        return Served(model, BACKEND, BACKEND, Completion(body, BACKEND))

    async def keep(self, model: str, whole: Body) -> None:
        """Keep a whole answer (its model set to the one that served), unless it is too large; with
        a semantic cache, its entry is made off the request's path."""
        prices = self.rt.policy.models[model].prices if model in self.rt.policy.models else None
        price = spend.cost(prices, whole.get("usage")) if prices is not None else 0.0
        raw = orjson.dumps({"model": model, "body": whole, "price": price, "at": time.time()})
        if len(raw) > self.spec.max_entry_bytes:
            log.info("response_cache_too_large", bytes=len(raw), limit=self.spec.max_entry_bytes)
            return
        try:
            await self.rt.store.cache_put(self.key, raw, self.spec.ttl_s)
        except StoreDown as exc:
            log.warning("response_cache_unavailable", error=exc.message)
            return
        if self.semantic is not None and (answer := answer_text(whole)):
            self.semantic.later(self._keep_similar(self.semantic, answer))

    async def _keep_similar(self, semantic: SemanticCache, answer: str) -> None:
        vector = self.vector if self.vector is not None else await semantic.embed(self.text)
        await semantic.keep(self.context, vector, self.key, answer)

    def kept_after(self, served: Served) -> Served:
        """A stream whose answer is kept once whole, at its end (one that fails or is left is not)."""
        assert served.stream is not None
        served.stream = _Recording(self, served.model, served.stream)
        return served

    @property
    def similar(self) -> bool:
        """The answer served is a similar request's (a semantic hit)."""
        return self.note.result == "hit" and (self.note.match or "").startswith("semantic")


def answer_text(whole: Body) -> str:
    """What a whole answer says, as text (its first choice: the content, else its tool calls)."""
    choice = (whole.get("choices") or [{}])[0]
    if "text" in choice:
        return str(choice.get("text") or "")
    message = choice.get("message") or {}
    if message.get("content"):
        return str(message["content"])
    return orjson.dumps(message.get("tool_calls") or []).decode() if message.get("tool_calls") else ""


class _Recording(ChunkStream):
    """A stream relayed as it comes, its chunks kept; whole at its end, its answer is kept."""

    def __init__(self, lookup: Lookup, model: str, inner: ChunkStream) -> None:
        self.first, self.replica = inner.first, inner.replica
        self._lookup, self._model, self._inner = lookup, model, inner

    async def __aiter__(self) -> AsyncIterator[Body]:
        seen: list[Body] = []
        async for chunk in self._inner:
            seen.append(orjson.loads(orjson.dumps(chunk)))  # as it came: the relay changes it once sent
            yield chunk
        whole = rules.assemble(self._lookup.kind, seen)
        if whole is not None:  # kept off the stream's end (a Redis write is a round trip before [DONE])
            whole["model"] = self._model
            self._lookup.rt.later(self._lookup.keep(self._model, whole))

    async def aclose(self) -> None:
        await self._inner.aclose()


def begin(rt: Runtime, kind: Kind, body: Body, ctx: Context, requested: str) -> Lookup | None:
    """The request's pass through the cache; None where the policy keeps no answers (or for
    embeddings). A request the cache must not answer gets a pass that only says why.
    ``requested``: the model the request named (the semantic cache is the policy's per model)."""
    spec = rt.policy.response_cache
    if spec is None or kind == "embedding":
        return None
    v = rules.verdict(spec, kind, body, ctx.cache)
    if not (v.read or v.write):
        return Lookup(rt, spec, kind, "", False, False, Note("bypass", why=v.why))
    # a key's answers are its secret's (its sha256), not its name's: a name made again with a new secret starts empty
    scope = ctx.key.sha256 if spec.scope == "key" and ctx.key is not None else "*"
    found = Lookup(rt, spec, kind, rules.key(rt.version, scope, kind, body), v.read, v.write, Note("miss"))
    semantic = rt.semantic
    if semantic is not None and requested in semantic.models and (text := rules.last_user_text(body)):
        found.semantic, found.text = semantic, text
        found.context = rules.context_key(rt.version, scope, kind, body)
    return found


def charge(model: str, note: Note) -> tuple[str, None, float]:
    """What a hit is charged, as spend records it: under ``cache:MODEL``, no tokens (no engine ran)."""
    return f"cache:{model}", None, note.charged


def replayed(lookup: Lookup, hit: Served, request_id: str, stream: bool, body: Body) -> Served:
    """A hit as this request gets it: a fresh id and time, whole or as a stream of chunks."""
    assert hit.completion is not None
    whole = dict(hit.completion.body)
    whole["id"] = ("chatcmpl-" if lookup.kind == "chat" else "cmpl-") + request_id
    whole["created"] = int(time.time())
    whole["model"] = hit.model
    if not stream:
        return Served(hit.model, BACKEND, BACKEND, Completion(whole, BACKEND))
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    chunks = rules.replay(lookup.kind, whole, usage)
    return Served(hit.model, BACKEND, BACKEND, None, ChunkStream(chunks[0], _rest(chunks[1:]), BACKEND))


async def _rest(chunks: list[Body]) -> AsyncIterator[Body]:
    for chunk in chunks:
        yield chunk
