"""Shared logic of the remote backends: replica choice, retries with backoff, timeouts,
passive ejection and active health checks. Transports (backends.http1 for OpenAI-compatible engines,
litellm for providers) implement two primitives: one call, and one opened stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog

from backends.admission import Admission, Slot
from backends.base import Attempt, Body, Call, Capabilities, ChunkStream, Completion, Stopwatch
from backends.engine_load import METRICS_PATH
from backends.engine_poll import EnginePoller
from backends.index_feed import Feed, IndexFeed
from backends.prefix import prompt_text
from backends.replicas import Dispatch, Placement, ReplicaSet, ReplicaState
from policies.errors import UpstreamError, UpstreamRejected, UpstreamTimeout
from policies.secrets import resolve_secret

log = structlog.get_logger("triage.backend")

# What an upstream's own words may hold that a client must never see: a credential, an address.
_LEAKS = re.compile(
    r"(?i)\bbearer\s+\S+|\bsk-[\w-]{4,}|\b[a-z][a-z0-9+.-]*://\S+"
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?|\[[0-9a-f:]+\](?::\d+)?|\blocalhost:\d+"
)


def scrub(text: str) -> str:
    """``text`` with anything that looks like a credential or an address replaced."""
    return _LEAKS.sub("[redacted]", text)


# An upstream's error code a client may read: a short identifier, never free text.
_CODE = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
# What engines say when a prompt does not fit (vLLM, llama.cpp's server, OpenAI, litellm's providers).
_TOO_LONG = re.compile(
    r"(?i)maximum context length|context (?:length|window)|exceeds? the context|too many tokens"
    r"|longer than the maximum model length|prompt is too long|context holds"
)


def too_long(message: str) -> bool:
    """Whether an engine's words say the prompt does not fit its context."""
    return _TOO_LONG.search(message) is not None


def upstream_failure(
    name: str,
    status: int,
    message: str,
    code: str | None = None,
    text: str = "generic",
) -> UpstreamError | UpstreamRejected:
    """An upstream's error answer as the client may see it; its own message goes to the log.

    401 and 403 are about the gateway's credentials for that replica, never the client's: a
    replica fault (ejected, tried elsewhere). 429 and 5xx are replica faults too. Any other 4xx
    is the request's fault: its status passes through with a generic message (``text``
    "scrubbed": the upstream's words, scrubbed), the upstream's code when it is an identifier,
    and ``context_length_exceeded`` when the upstream said the prompt does not fit."""
    if status in (401, 403):
        return UpstreamError(
            f"upstream {name} refused the gateway's credentials (HTTP {status})",
            upstream_status=status,
            detail=message,
            code="upstream_auth_failed",
        )
    if status >= 500 or status == 429:
        return UpstreamError(f"upstream {name} answered {status}", upstream_status=status, detail=message)
    code = code if isinstance(code, str) and _CODE.fullmatch(code) else None
    if too_long(message):
        code = "context_length_exceeded"
    said = "the prompt does not fit its context" if code == "context_length_exceeded" else "refused the request"
    shown = scrub(message) if text == "scrubbed" else f"upstream {name} {said} (HTTP {status})"
    return UpstreamRejected(shown, status=status, code=code, detail=message)


class RemoteBackend:
    capabilities = Capabilities(embeddings=True)  # an OpenAI-compatible engine's /v1/embeddings

    def __init__(self, name: str, spec: Any) -> None:
        self.name = name
        self.spec = spec
        states = [ReplicaState(r.api_base, resolve_secret(r.api_key), r.weight) for r in spec.replicas]
        d = spec.dispatch
        self.replicas = ReplicaSet(
            states,
            spec.rule,
            spec.health.cooldown_s,
            dispatch=Dispatch(
                balance=d.balance,
                slack=d.slack,
                block_tokens=d.block_tokens,
                bytes_per_token=d.bytes_per_token,
                cache_tokens=d.cache_tokens,
                batch_max_load=d.batch_max_load,
                signals_ttl_s=d.stale_s or max(1.0, 3 * d.interval_s),
            ),
        )
        self.poller = (
            None
            if d.engine == "none"
            else EnginePoller(
                name,
                self.replicas,
                self._fetch,
                d.engine,
                d.metrics_path or METRICS_PATH[d.engine],
                d.interval_s,
                d.timeout_s,
            )
        )
        self.feed: IndexFeed | None = None
        a = spec.admission
        self.admission = (
            None
            if a is None
            else Admission(
                self.replicas,
                slots=a.slots,
                max_skips=a.max_skips,
                window_ms=a.window_ms,
                cached_prompts=a.cached_prompts or min(a.slots, 64),
                min_shared_tokens=a.min_shared_tokens,
            )
        )
        self._health_task: asyncio.Task[None] | None = None

    # -- transport primitives ------------------------------------------------------------
    async def _call_once(self, replica: ReplicaState, call: Call) -> Body:
        raise NotImplementedError

    async def _open_once(self, replica: ReplicaState, call: Call) -> AsyncIterator[Body]:
        raise NotImplementedError

    async def _probe(self, replica: ReplicaState) -> bool:
        raise NotImplementedError

    async def _fetch(self, replica: ReplicaState, path: str) -> tuple[int, str, bytes]:
        """GET ``path`` under the replica's server root: (status, content type, body)."""
        raise NotImplementedError

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self.spec.health.enabled:
            self._health_task = asyncio.create_task(self._health_loop(), name=f"health:{self.name}")
        if self.poller is not None:
            self.poller.start()

    async def share(self, store: Feed | None) -> None:
        """Share the prefix index with the other gateways through ``store`` (None: stop sharing)."""
        if self.feed is not None and self.feed.store is store:
            return
        if self.feed is not None:
            await self.feed.close()
            self.feed = None
        if store is not None and self.spec.dispatch.share and self.replicas.indexed:
            self.feed = IndexFeed(self.name, self.replicas, store)
            await self.feed.start()

    async def close(self) -> None:
        if self.poller is not None:
            await self.poller.close()
        await self.share(None)
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task

    def healthy(self) -> bool:
        return self.replicas.any_available()

    async def context_length(self, upstream: str) -> int | None:
        return None  # a transport that can ask its engine says so (OpenAICompatBackend)

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.spec.health.interval_s)

    async def check_health(self) -> None:
        async def one(r: ReplicaState) -> None:
            try:
                async with asyncio.timeout(self.spec.health.timeout_s):
                    ok = await self._probe(r)
            except (TimeoutError, UpstreamError):
                ok = False
            if ok != r.active_ok:
                log.info("replica_health", backend=self.name, replica=r.api_base, healthy=ok)
            r.active_ok = ok

        await asyncio.gather(*(one(r) for r in self.replicas.replicas))

    # -- calls ----------------------------------------------------------------------------
    async def complete(self, call: Call) -> Completion:
        slot = await self._admit(call)
        try:
            return await self._complete(call, slot)
        finally:
            if slot is not None:
                slot.release()

    async def _complete(self, call: Call, slot: Slot | None) -> Completion:
        t = self.spec.timeouts
        tried: set[str] = set()
        last: UpstreamError | None = None
        for i in range(self.spec.retries.attempts):
            placed = await self._next(tried, call, slot)
            replica = placed.replica
            watch = Stopwatch()
            try:
                async with asyncio.timeout(t.total_s):  # unstreamed: headers come with the last token
                    body = await self._call_once(replica, call)
            except (TimeoutError, UpstreamError, UpstreamRejected) as exc:
                last = self._failed(call, replica, watch, exc)
                await self._backoff(i)
                continue
            finally:
                replica.outstanding -= 1
                self.replicas.started(placed)
            self._record(call, replica, "ok", watch)
            if self.replicas.indexed:
                self._answered(call, replica, _answer(body, "message"))
            return Completion(body, replica.api_base)
        assert last is not None
        raise last

    async def open_stream(self, call: Call) -> ChunkStream:
        slot = await self._admit(call)
        try:
            return await self._open_stream(call, slot)
        except BaseException:
            if slot is not None:
                slot.release()
            raise

    async def _open_stream(self, call: Call, slot: Slot | None) -> ChunkStream:
        t = self.spec.timeouts
        tried: set[str] = set()
        last: UpstreamError | None = None
        for i in range(self.spec.retries.attempts):
            placed = await self._next(tried, call, slot)
            replica = placed.replica
            watch = Stopwatch()
            chunks: AsyncIterator[Body] | None = None
            try:
                async with asyncio.timeout(min(t.first_byte_s, t.total_s)):
                    chunks = await self._open_once(replica, call)
                    first = await anext(chunks)
            except BaseException as exc:  # cleanup for all; only the listed kinds are retried
                replica.outstanding -= 1
                self.replicas.started(placed)
                if chunks is not None:
                    await _aclose(chunks)
                if not isinstance(exc, TimeoutError | UpstreamError | UpstreamRejected | StopAsyncIteration):
                    raise
                if isinstance(exc, StopAsyncIteration):
                    exc = UpstreamError("upstream closed the stream before the first chunk")
                elif isinstance(exc, UpstreamError) and chunks is not None:
                    exc.retryable = True  # nothing reached the client yet: safe to try again
                last = self._failed(call, replica, watch, exc)
                await self._backoff(i)
                continue
            self.replicas.started(placed)
            self._record(call, replica, "ok", watch)
            cleanup = _once(replica, chunks, slot)
            said = _answer(first, "delta") if self.replicas.indexed else ""
            rest = self._rest(call, replica, chunks, watch, cleanup, said)
            return ChunkStream(first, rest, replica.api_base, cleanup)
        assert last is not None
        raise last

    async def _rest(
        self,
        call: Call,
        replica: ReplicaState,
        chunks: AsyncIterator[Body],
        watch: Stopwatch,
        cleanup: Callable[[], Awaitable[None]],
        said: str = "",
    ) -> AsyncIterator[Body]:
        t = self.spec.timeouts
        keep = self.replicas.indexed  # the answer's text, for the prefix index
        parts = [said] if keep else []
        try:
            while True:
                budget = min(t.idle_s, t.total_s - watch.elapsed())
                try:
                    async with asyncio.timeout(max(budget, 0.0)):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    if keep:
                        self._answered(call, replica, "".join(parts))
                    return
                except TimeoutError:
                    self._record(call, replica, "stream_timeout", watch)
                    self.replicas.eject(replica)
                    raise UpstreamTimeout("upstream stream stalled") from None
                except UpstreamError:
                    self._record(call, replica, "stream_error", watch)
                    self.replicas.eject(replica)
                    raise
                if keep:
                    parts.append(_answer(chunk, "delta"))
                yield chunk
        finally:
            await cleanup()

    # -- helpers --------------------------------------------------------------------------
    def _affinity(self, call: Call) -> str | None:
        """The call's own key (a batch group), else, with ``prefix_affinity_chars``, the start of
        its prompt: requests that share it prefer one replica, whose prefix cache then hits."""
        if call.affinity is not None or not self.spec.prefix_affinity_chars:
            return call.affinity
        return prompt_text(call.body)[: self.spec.prefix_affinity_chars]

    async def _admit(self, call: Call) -> Slot | None:
        """With ``admission``: wait for the replica slot the waiting room gives this call."""
        if self.admission is None:
            return None
        try:
            return await self.admission.acquire(prompt_text(call.body), self.spec.timeouts.total_s)
        except UpstreamTimeout:
            log.warning(
                "admission_timeout",
                backend=self.name,
                request_id=call.request_id,
                waiting=self.admission.waiting,
                waited_s=self.spec.timeouts.total_s,
            )
            raise

    async def _next(self, tried: set[str], call: Call, slot: Slot | None = None) -> Placement:
        """The first try goes to the admitted slot's replica; any other by the strategy. A
        background call (a batch line) waits until a replica has spare room: online goes first."""
        if slot is not None and not tried:
            placed: Placement | None = Placement(slot.replica)
        else:
            text = prompt_text(call.body) if self.replicas.indexed else ""
            affinity = self._affinity(call)
            placed = self.replicas.place(tried, affinity, text=text, background=call.background)
            waited = 0
            while placed is None:  # only a background call: no replica has room for it now
                if waited % 200 == 0:
                    log.info("batch_line_waits", backend=self.name, request_id=call.request_id, waited_s=waited / 20)
                await asyncio.sleep(0.05)
                waited += 1
                placed = self.replicas.place(tried, affinity, text=text, background=True)
        assert placed is not None
        tried.add(placed.replica.api_base)
        placed.replica.outstanding += 1
        return placed

    def _answered(self, call: Call, replica: ReplicaState, answer: str) -> None:
        """The engine now caches the prompt and its answer: a conversation's next turn starts so."""
        if answer:
            self.replicas.extend(replica, prompt_text(call.body) + "\n" + answer)

    def _failed(self, call: Call, replica: ReplicaState, watch: Stopwatch, exc: BaseException) -> UpstreamError:
        """Record a failed try; re-raise what must not be retried, return what may be."""
        if isinstance(exc, UpstreamRejected):
            self._record(call, replica, "rejected", watch)
            log.info(
                "upstream_rejected",
                backend=self.name,
                request_id=call.request_id,
                status=exc.status,
                code=exc.code,
                detail=exc.detail[:2000],
            )
            raise exc
        if isinstance(exc, TimeoutError):
            exc = UpstreamTimeout(f"upstream {self.name} timed out")
        assert isinstance(exc, UpstreamError)
        timed_out = isinstance(exc, UpstreamTimeout)
        self._record(call, replica, "timeout" if timed_out else "error", watch)
        self.replicas.eject(replica, exc.retry_after_s)
        log.warning(
            "upstream_failed",
            backend=self.name,
            replica=replica.api_base,
            request_id=call.request_id,
            error=exc.message,
            status=exc.upstream_status,
            detail=exc.detail,
        )
        if not exc.retryable or (timed_out and not self.spec.retries.on_timeout):
            raise exc
        return exc

    async def _backoff(self, i: int) -> None:
        r = self.spec.retries
        if i + 1 >= r.attempts:
            return
        delay = min(r.max_backoff_s, r.backoff_s * (2**i))
        await asyncio.sleep(delay * (0.5 + random.random() / 2))

    def _record(self, call: Call, replica: ReplicaState, outcome: str, watch: Stopwatch) -> None:
        call.attempts.append(Attempt(self.name, replica.api_base, outcome, watch.elapsed()))


def _once(replica: ReplicaState, chunks: AsyncIterator[Body], slot: Slot | None) -> Callable[[], Awaitable[None]]:
    """Release a stream's replica slot and connection exactly once, started or not."""
    done = False

    async def cleanup() -> None:
        nonlocal done
        if not done:
            done = True
            replica.outstanding -= 1
            if slot is not None:
                slot.release()
            await _aclose(chunks)

    return cleanup


def _answer(body: Body, part: str) -> str:
    """The text of an answer's (``message``) or a chunk's (``delta``) first choice; "" if none."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    inner = c.get(part)
    text = inner.get("content") if isinstance(inner, dict) else c.get("text")
    return text if isinstance(text, str) else ""


async def _aclose(it: AsyncIterator[Body]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()
