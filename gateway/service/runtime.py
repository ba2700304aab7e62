"""The live state a policy becomes: started backends and resolved keys, swapped atomically.

A request pins the runtime it started with; backends that a reload dropped are closed only
once the last request that pinned the old runtime has finished.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from backends.base import Backend
from backends.engine_handle import EngineHandle
from gateway.state.buffered import Buffered
from gateway.state.memory_redis import MemoryFeed
from gateway.state.recent_redis import RecentFeed
from gateway.state.responses import Responses
from gateway.state.stores import MemoryStore, Store
from policies import plans
from policies.budget import EscalationBudget
from policies.errors import Unauthorized
from policies.fit import Fit
from policies.memory import Memory
from policies.schema import ApiKey, Policy, RoutedModel

if TYPE_CHECKING:  # the rooms above the request core, named in its fields' types only
    from classifiers.confidence import ConfidenceModel
    from classifiers.quality import QualityHead
    from gateway.service.cache.semantic import SemanticCache
    from gateway.service.encoding import Encoding, Probe
    from gateway.service.guardrails.checks import Guardrails
    from gateway.service.keys.keyring import Keyring
    from gateway.service.quality.watch import Watch

log = structlog.get_logger("triage.runtime")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(eq=False)
class Runtime:
    policy: Policy
    backends: dict[str, Backend]
    key_hashes: frozenset[str]
    encoding: Encoding | None = None
    quality: dict[str, QualityHead] = field(default_factory=dict)  # routed virtual model -> its heads
    probe_heads: dict[str, QualityHead] = field(default_factory=dict)  # routed model -> its probe's head
    budget: EscalationBudget | None = None  # the cascade's online escalation budget (a policy's own)
    judges: dict[str, ConfidenceModel] = field(default_factory=dict)  # tier -> its learned gate
    in_flight: int = 0
    retired: bool = False
    store: Store = field(default_factory=MemoryStore)  # rate windows and spend (policy: state)
    store_problem: str | None = None  # the store was down at start and the policy allows degraded mode
    responses: Responses | None = None  # stored Responses in the fleet's store (None: the app's own, this process)
    recent: RecentFeed | None = None  # the console's ring shared by the fleet (state.store: redis)
    store_checked: float = 0.0  # when a degraded store was last asked whether it is back (monotonic)
    operator_hashes: frozenset[str] = frozenset()  # keys that see every key's files and batches
    keyring: Keyring | None = None  # who may call (None: the policy's keys only, no store keys)
    admin_digest: str | None = None  # the admin API's key's sha256 (None: /admin is off)
    version: str = ""  # the policy and its artifacts, hashed: what the decision cache is keyed on
    fits: dict[str, Fit] = field(default_factory=dict)  # model -> what it takes (policies.fit)
    base_dir: Path = Path(".")  # the policy file's folder
    tokenizers: dict[str, Any] = field(default_factory=dict)  # model -> its tokenizer, once loaded (fitting)
    semantic: SemanticCache | None = None  # the response cache's similar-request index (policy: response_cache)
    watch: Watch | None = None  # records, shadow checks, feedback (policy: quality)
    # the generate path composed at assembly (gateway.service.job.Serve: the core within the quality
    # watch and the response cache; None: the core alone), and the watch's note of each decision
    serve: Callable[..., Awaitable[Any]] | None = None
    noted: Callable[..., None] | None = None
    guardrails: Guardrails | None = None  # the policy's guardrails (the serve path's outer layer), and their tally
    recall: Memory | None = None  # the cascade's memory of the last tier's answers (policy: cascade.memory)
    memory_feed: MemoryFeed | None = None  # ... shared by the fleet (state.store: redis, cascade.memory.shared)
    _reach: dict[tuple[str, ...], frozenset[str]] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)  # work after an answer (cache writes)

    def later(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` off the request's path (a failure is logged); :meth:`settled` waits for it."""

        async def run() -> None:
            try:
                await work
            except Exception as exc:
                log.warning("background_failed", error=repr(exc)[:300])

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settled(self, timeout_s: float = 10.0) -> None:
        """Until the work started by :meth:`later` (and the semantic cache's) is done, at most ``timeout_s``."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        if self.semantic is not None:
            await self.semantic.close()

    def probe(self, name: str) -> Probe | None:
        """The difficulty probe of routed model ``name`` (None: it has none)."""
        from backends.probe import ProbeBackend
        from gateway.service.encoding import Probe

        vm = self.policy.virtual_models.get(name)
        head = self.probe_heads.get(name)
        if not isinstance(vm, RoutedModel) or vm.probe is None or head is None:
            return None
        backend = self.backends[vm.probe.backend]
        assert isinstance(backend, ProbeBackend), "validation: a probe names a gguf_probe backend"
        return Probe(vm.probe, backend, head)

    def reach(self, key: ApiKey | None) -> frozenset[str] | None:
        """Every model ``key`` may be served by (:func:`policies.plans.reach`); None: any."""
        if key is None or key.models is None:
            return None
        names = tuple(key.models)
        if (found := self._reach.get(names)) is None:
            if len(self._reach) >= 1024:  # store keys come and go: bounded
                self._reach.clear()
            found = self._reach[names] = plans.reach(self.policy, names)
        return found

    @property
    def keys_required(self) -> bool:
        required = self.keyring is not None and self.keyring.required  # tokens too (access.tokens)
        return required or bool(self.key_hashes) or self.admin_digest is not None

    async def authenticate(self, authorization: str | None, send: str = "Authorization: Bearer <key>") -> ApiKey | None:
        """The key (or signed token) sent, checked: None when the gateway runs without keys;
        Unauthorized (401) when it is missing, unknown, revoked or a bad token; StoreDown (503) when
        a store key cannot be looked up."""
        if not self.keys_required:
            return None
        key = await self.keyring.caller(authorization) if self.keyring is not None else None
        if key is None:
            raise Unauthorized(f"Incorrect, revoked or missing API key: send '{send}'")
        return key

    def key_digest(self, authorization: str | None) -> str | None:
        """The sha256 of the bearer key sent, None without one (what the keys are looked up by, and
        what a caller's files, batches and stored Responses belong to). A signed token's is its
        issuer's and subject's, the same across the user's tokens: asked once ``authenticate`` has
        verified it."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        credential = authorization[7:].strip()
        if self.keyring is not None and (digest := self.keyring.token_subject(credential)) is not None:
            return digest
        return hashlib.sha256(credential.encode()).hexdigest()

    def ready(self) -> bool:
        return any(b.healthy() for b in self.backends.values())

    @functools.cached_property
    def admission(self) -> bool:
        """A backend holds requests in a waiting room (``admission``)."""
        return any(getattr(b, "admission", None) is not None for b in self.backends.values())

    @functools.cached_property
    def local_engines(self) -> bool:
        """A backend runs a local engine (one request at a time per context: the others wait their
        turn, and a request whose client left must give its turn back at once)."""
        return any(isinstance(getattr(b, "engine", None), EngineHandle) for b in self.backends.values())


class RuntimeHolder:
    """The current runtime, and the retired ones that still have requests in flight.

    A backend (or the encoder) that a reload dropped is closed once no live runtime uses it:
    not the current one, and none of the retired ones still serving a request. Counting per
    object, not per runtime, matters when reloads come quickly: A -> B (keeps X) -> C (drops X)
    must not close X while a request pinned to A still streams from it.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.current = runtime
        self._retired: list[Runtime] = []
        # by id: objects of retired runtimes
        self._pending: dict[int, Backend | Encoding | Store | Watch | Responses | RecentFeed | MemoryFeed] = {}
        self._later: set[asyncio.Task[None]] = set()  # work after an answer (spend records): awaited at close

    def later(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` after the answer, in the background; :meth:`close` waits for it."""
        task = asyncio.get_running_loop().create_task(work)
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    def acquire(self) -> Runtime:
        rt = self.current
        rt.in_flight += 1
        return rt

    async def release(self, rt: Runtime) -> None:
        rt.in_flight -= 1
        if rt.retired and rt.in_flight == 0:
            await self._collect()

    async def swap(self, new: Runtime) -> None:
        old, self.current = self.current, new
        old.retired = True
        self._retired.append(old)
        # the fleet's ring and memory before the store: their last writes go through the store's client
        for obj in (
            *old.backends.values(),
            old.encoding,
            old.recent,
            old.memory_feed,
            old.store,
            old.watch,
            old.responses,
        ):
            if obj is not None:
                self._pending[id(obj)] = obj
        await self._collect()

    async def close(self) -> None:
        if self._later:
            await asyncio.wait(self._later, timeout=10)
        await self.current.settled()
        for backend in self.current.backends.values():
            await backend.close()
        if self.current.encoding is not None:
            await self.current.encoding.close()
        for feed in (self.current.recent, self.current.memory_feed):
            if feed is not None:
                await feed.close()  # before the store: its last write goes through the store's client
        await self.current.store.close()
        if self.current.watch is not None:
            await self.current.watch.close()
        if self.current.responses is not None:
            await self.current.responses.close()

    async def _collect(self) -> None:
        self._retired = [rt for rt in self._retired if rt.in_flight > 0]
        live = {
            id(obj)
            for rt in (self.current, *self._retired)
            for obj in (*rt.backends.values(), rt.encoding, rt.store, rt.watch, rt.responses, rt.recent, rt.memory_feed)
            if obj is not None
        }
        closing = [obj for key, obj in self._pending.items() if key not in live]
        closing.sort(key=lambda obj: not isinstance(obj, Buffered))  # the writers before the store they write through
        self._pending = {key: obj for key, obj in self._pending.items() if key in live}
        for obj in closing:
            log.info("backend_closed", backend=getattr(obj, "name", "encoder"))
            await obj.close()
