"""Assembling the runtime a policy becomes (``build``): its backends started, its keys resolved, its
state store opened, the encoder, the semantic cache, the quality watch, the judges and fits read.
What the start refuses is said before it (``secret_problems``: ``triage serve``, ``triage doctor``).
The runtime itself, and the holder that swaps it, are :mod:`gateway.service.runtime`.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from backends import crash_guard, registry
from backends.base import Backend
from gateway.service import assemble_state, service
from gateway.service.cache import layer as cache_layer
from gateway.service.cache.semantic import SemanticCache
from gateway.service.guardrails import layer as guard_layer
from gateway.service.guardrails.checks import Guardrails
from gateway.service.job import Serve
from gateway.service.keys.keyring import Keyring, keyring_for
from gateway.service.quality import layer as quality_layer
from gateway.service.quality.watch import Watch
from gateway.service.runtime import Runtime
from gateway.state.quality import open_quality
from gateway.state.stores import Store, StoreDown
from policies import loader
from policies.budget import EscalationBudget
from policies.errors import NotReady, PolicyInvalid, TriageError
from policies.fit import Fit
from policies.memory import Memory
from policies.schema import Policy, SplitModel
from policies.secrets import MissingSecret, resolve_secret
from policies.semantic_cache import Vector
from policies.tiers import ScorerTier

if TYPE_CHECKING:
    from classifiers.confidence import ConfidenceModel
    from classifiers.quality import QualityHead
    from gateway.service.encoding import Encoding

log = structlog.get_logger("triage.runtime")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def secret_problems(policy: Policy) -> list[str]:
    """What the keys' and the admin key's secrets lack (unset, or not a hex sha256): what the start
    refuses, said before it (``triage serve``, ``triage doctor``)."""
    problems = []
    for check in (_key_hashes, _admin_digest):
        try:
            check(policy)
        except PolicyInvalid as exc:
            problems += exc.problems
    return problems


def _key_hashes(policy: Policy) -> list[tuple[str, str]]:
    """Each key's name and hex sha256 (names may repeat: a key being rotated)."""
    hashes: list[tuple[str, str]] = []
    for i, key in enumerate(policy.keys):
        try:
            value = resolve_secret(key.sha256)
        except MissingSecret as exc:
            raise PolicyInvalid([f"keys[{i}].sha256: {exc}"]) from None
        value = (value or "").strip().lower()
        if not _HEX64.match(value):
            raise PolicyInvalid([f"keys[{i}].sha256: {key.sha256} does not hold a hex sha256"])
        hashes.append((key.name, value))
    return hashes


async def _encoding(
    policy: Policy, previous: Runtime | None, base_dir: Path
) -> tuple[Encoding | None, dict[str, QualityHead], dict[str, QualityHead]]:
    """The encoder and its heads (reused when unchanged), the routed models' quality heads, and
    their probes' heads."""
    if policy.classifier is None:
        return None, {}, {}
    from gateway.service.encoding import Encoding, artifacts_signature, load_quality  # ONNX Runtime: only when asked
    from policies.semantic import label_problems

    old = previous.encoding if previous is not None else None
    if (
        old is not None
        and old.config == policy.classifier
        and old.signature == artifacts_signature(policy.classifier, base_dir)
    ):
        encoding = old  # same settings, same trained heads: keep the loaded encoder
    else:
        try:
            encoding = await Encoding.load(policy.classifier, base_dir)
        except NotReady as exc:
            raise PolicyInvalid([f"classifier: {exc.message}"]) from None
    problems = label_problems(policy, encoding.classifier.classes())
    # off the event loop: a reload loads them while requests are served (a knn head holds its dev rows)
    loaded = await asyncio.to_thread(load_quality, policy, base_dir, encoding.classifier.encoder.dim)
    heads, probe_heads, quality_problems = loaded
    problems += quality_problems
    if problems:
        if encoding is not old:
            await encoding.close()
        raise PolicyInvalid(problems)
    return encoding, heads, probe_heads


async def build(
    policy: Policy,
    previous: Runtime | None = None,
    base_dir: Path = Path("."),
    source: Path | None = None,
    *,
    engines: bool = True,
) -> Runtime:
    """Start the backends of ``policy``, reusing those of ``previous`` whose spec is unchanged.

    Relative paths in the policy (classifier data and artifacts) are taken from ``base_dir``;
    ``source``: the policy file, to place a problem found against the engines (file:line:col);
    ``engines`` False: the backends are made but not started (no engine's worker process, no health
    check) and nothing is asked of them (no fits): a runtime that routes, not one that serves.
    What this start opened is closed again when a later step fails.
    """
    keys = _key_hashes(policy)
    admin = _admin_digest(policy)
    judges = load_judges(policy, base_dir)
    guards = Guardrails.build(policy, base_dir, previous.guardrails if previous is not None else None)
    cached = policy.response_cache is not None or (
        policy.cascade is not None and policy.cascade.cache_ttl_s is not None
    )
    version = await asyncio.to_thread(policy_version, policy, base_dir) if cached else ""
    store, problem = await assemble_state.open_state(policy, previous, admin)
    opened = _Opened(previous, store)
    try:
        watch = opened.watch = await _watch(policy, previous, base_dir, source)
        if watch is not None:  # the guarded splits of this policy (weights that changed forget their rollbacks)
            watch.guard.watch({n: vm for n, vm in policy.virtual_models.items() if isinstance(vm, SplitModel)})
        encoding, quality, probe_heads = await _encoding(policy, previous, base_dir)
        opened.encoding = encoding
        backends = await _backends(policy, previous, opened.started, engines)
        if engines:
            await _share(policy, backends, store)
        fits = await _fits(policy, backends, source) if engines else {}
    except BaseException:
        await opened.close()
        raise
    hashes, operators, keyring = _keyring(policy, keys, store, admin)
    responses = await assemble_state.responses_for(policy, previous, store, opened.close) if engines else None
    crash_guard.guard().log_content = policy.logging.log_prompts  # the engines' crash logs
    recall = _recall(policy, previous)
    return Runtime(
        policy,
        backends,
        hashes,
        encoding,
        quality,
        probe_heads,
        _budget(policy),
        judges,
        store=store,
        store_problem=problem,
        operator_hashes=operators,
        keyring=keyring,
        admin_digest=admin,
        version=version,
        fits=fits,
        base_dir=base_dir,
        semantic=_semantic(policy, encoding, version, store),
        responses=responses,
        recent=assemble_state.recent_for(policy, previous, store),
        watch=watch,
        serve=layered(policy, guards),
        guardrails=guards,
        noted=quality_layer.noted if watch is not None else None,
        recall=recall,
        memory_feed=assemble_state.memory_feed_for(policy, previous, store, recall),
    )


def _keyring(
    policy: Policy, keys: list[tuple[str, str]], store: Store, admin: str | None
) -> tuple[frozenset[str], frozenset[str], Keyring]:
    """The policy's keys' digests, the operators' among them, and the keyring that looks keys up
    (the admin API's too, where there is an admin key). Each key as looked up carries its sha256
    itself (an `env:` one resolved): what it owns is kept under it."""
    hashes = frozenset(digest for _, digest in keys)
    operators = frozenset(digest for name, digest in keys if name in policy.access.operator_keys)
    by_digest = {digest: policy.keys[i].model_copy(update={"sha256": digest}) for i, (_, digest) in enumerate(keys)}
    return hashes, operators, keyring_for(policy, by_digest, store, admin is not None)


@dataclass
class _Opened:
    """What one start opened (not the previous runtime's, which it may reuse): closed on a failure."""

    previous: Runtime | None
    store: Store
    watch: Watch | None = None
    encoding: Encoding | None = None
    started: list[Backend] = field(default_factory=list)

    async def close(self) -> None:
        prev = self.previous
        for backend in self.started:
            await backend.close()
        if self.encoding is not None and (prev is None or self.encoding is not prev.encoding):
            await self.encoding.close()
        if prev is None or self.store is not prev.store:
            await self.store.close()
        if self.watch is not None and (prev is None or self.watch is not prev.watch):
            await self.watch.close()


async def _backends(
    policy: Policy, previous: Runtime | None, started: list[Backend], engines: bool = True
) -> dict[str, Backend]:
    """Every backend of ``policy``: the previous runtime's where its spec is unchanged, else built
    and started (each started one added to ``started``, to be closed if the start fails; with
    ``engines`` False, built only)."""
    backends: dict[str, Backend] = {}
    for name, spec in policy.backends.items():
        if previous is not None and previous.policy.backends.get(name) == spec:
            backends[name] = previous.backends[name]
            continue
        try:
            backend = registry.build(name, spec)
        except MissingSecret as exc:
            raise PolicyInvalid([f"backends.{name}: {exc}"]) from None
        if engines:
            await backend.start()
        started.append(backend)
        backends[name] = backend
    return backends


async def _share(policy: Policy, backends: dict[str, Backend], store: Store) -> None:
    """Remote pools share their prefix index through the fleet's store (``backends/index_feed.py``)
    where the state is shared (Redis); else each gateway keeps its own."""
    shared = store if policy.state.store == "redis" else None
    for backend in backends.values():
        share = getattr(backend, "share", None)
        if share is not None:
            await share(shared)


def layered(policy: Policy, guards: Guardrails | None = None) -> Serve:
    """The generate path a policy serves by: the core (:func:`gateway.service.service.serve`),
    within the quality watch (a policy with a ``quality`` section), within the response cache (one
    with ``response_cache``): a hit is answered before the watch, as no engine ran; all within the
    guardrails (a refused request is looked up nowhere, and a cached answer is checked too)."""
    out: Serve = service.serve
    if policy.quality is not None:
        out = quality_layer.watched(out)
    if policy.response_cache is not None:
        out = cache_layer.cached(out)
    if guards is not None:
        out = guard_layer.guarded(out, guards)
    return out


async def _watch(policy: Policy, previous: Runtime | None, base_dir: Path, source: Path | None) -> Watch | None:
    """The quality watch, where the policy has a `quality` section: the previous one while its
    section and the state's database are unchanged (its store and counters live on), else a new one."""
    spec = policy.quality
    if spec is None:
        return None
    if (
        previous is not None
        and previous.watch is not None
        and previous.policy.quality == spec
        and previous.policy.state.database == policy.state.database
    ):
        return previous.watch
    from policies.paths import cache_dir

    if spec.path is not None:
        path = (base_dir / spec.path).resolve()
    else:
        origin = str((source or base_dir).resolve()).encode()
        path = cache_dir() / "quality" / f"{hashlib.sha1(origin).hexdigest()[:16]}.sqlite3"
    try:
        store = await open_quality(policy.state, path)
    except StoreDown as exc:
        raise PolicyInvalid([f"quality: {exc.message}"]) from None
    watch = Watch(spec, store)
    watch.start()
    return watch


def _semantic(policy: Policy, encoding: Encoding | None, version: str, store: Store) -> SemanticCache | None:
    """The semantic response cache, where the policy asks for one (its encoder: the classifier's)."""
    spec = policy.response_cache.semantic if policy.response_cache is not None else None
    if spec is None:
        return None
    assert encoding is not None, "validated: a semantic cache needs a classifier"
    embedder = encoding.embedder

    async def embed(text: str) -> Vector:
        vector, _ = await embedder.embed(text)
        return vector

    return SemanticCache(spec, embed, encoding.classifier.encoder.dim, version, store)


async def _fits(policy: Policy, backends: dict[str, Backend], source: Path | None) -> dict[str, Fit]:
    """What each model takes: the policy's declared context, tools and images, else what its engine
    and backend say. A declared context larger than the engine's is a start-up problem."""

    async def said(name: str) -> int | None:
        try:
            async with asyncio.timeout(10):
                return await backends[policy.models[name].backend].context_length(policy.upstream_name(name))
        except (TimeoutError, TriageError):
            return None

    engines = dict(zip(policy.models, await asyncio.gather(*(said(m) for m in policy.models)), strict=True))
    fits: dict[str, Fit] = {}
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for name, spec in policy.models.items():
        caps, engine, declared = backends[spec.backend].capabilities, engines[name], spec.context_length
        if declared is not None and engine is not None and declared > engine:
            problems.append(
                (
                    ("models", name, "context_length"),
                    f"{declared} tokens declared, but its engine (backend '{spec.backend}') takes {engine}",
                )
            )
        fits[name] = Fit(
            declared if declared is not None else engine,
            spec.tools if spec.tools is not None else caps.tools,
            spec.images if spec.images is not None else caps.images,
            "declared" if declared is not None else "engine" if engine is not None else "unknown",
            spec.json_schema if spec.json_schema is not None else caps.json_schema,
        )
    if problems:
        raise PolicyInvalid(loader.located(source, problems))
    return fits


def _admin_digest(policy: Policy) -> str | None:
    ref = policy.access.admin_key
    if ref is None:
        return None
    try:
        value = resolve_secret(ref)
    except MissingSecret as exc:
        raise PolicyInvalid([f"access.admin_key: {exc}"]) from None
    value = (value or "").strip().lower()
    if not _HEX64.match(value):
        raise PolicyInvalid([f"access.admin_key: {ref} does not hold a hex sha256"])
    return value


def policy_version(policy: Policy, base_dir: Path) -> str:
    """The policy as served, hashed with every file of its trained artifacts folders (their bytes;
    name, size and time for a file over 64 MB): a reload that changes either changes it (the
    decision cache's key), and gateways serving the same files agree on it."""
    h = hashlib.sha256(policy.model_dump_json().encode())
    folders = {judges_dir(policy, base_dir)}
    if policy.classifier is not None:
        folders.add((base_dir / policy.classifier.artifacts).resolve())
    for folder in sorted(str(f) for f in folders if f is not None):
        for path in sorted(Path(folder).rglob("*")) if Path(folder).is_dir() else []:
            if path.is_file():
                st = path.stat()
                h.update(f"{path.relative_to(folder)}:{st.st_size}".encode())
                h.update(path.read_bytes() if st.st_size <= 64 << 20 else str(st.st_mtime_ns).encode())
    return h.hexdigest()[:16]


def judges_dir(policy: Policy, base_dir: Path) -> Path | None:
    """Where the cascade's learned gates are: its own ``artifacts``, else the classifier's."""
    c = policy.cascade
    if c is not None and c.artifacts is not None:
        return (base_dir / c.artifacts).resolve()
    if policy.classifier is not None:
        return (base_dir / policy.classifier.artifacts).resolve()
    return None


def load_judges(policy: Policy, base_dir: Path) -> dict[str, ConfidenceModel]:
    """The confidence model of every tier with ``gate: learned``; a missing one stops the start."""
    c = policy.cascade
    learned = [t.name for t in (c.tiers if c is not None else []) if t.gate == "learned"]
    if not learned:
        return {}
    from classifiers.confidence import ConfidenceModel

    where = judges_dir(policy, base_dir)
    if where is None:
        raise PolicyInvalid(
            ["cascade: a tier has `gate: learned` but neither cascade.artifacts nor a classifier says where"]
        )
    out: dict[str, ConfidenceModel] = {}
    problems = []
    temperatures = {t.name: dict(t.temperature) for t in c.tiers} if c is not None else {}
    margins = {t.name: t.escalation_margin for t in c.tiers} if c is not None else {}
    orders = {t.name: t.orders if isinstance(t, ScorerTier) else 1 for t in c.tiers} if c is not None else {}
    for name in learned:
        try:
            out[name] = ConfidenceModel.load(where, name)
        except NotReady as exc:
            problems.append(f"cascade.tiers.{name}: {exc.message}")
            continue
        fitted = out[name].meta.get("temperature")
        if fitted is not None and fitted != temperatures[name]:
            problems.append(
                f"cascade.tiers.{name}: its learned gate was fitted at temperature {fitted}, the policy says "
                f"{temperatures[name]}: run `triage train --policy POLICY` again"
            )
        if (read_in := out[name].meta.get("orders", 1)) != orders[name]:
            problems.append(
                f"cascade.tiers.{name}: its learned gate was fitted on answers read in {read_in} order(s) of the "
                f"options, the policy reads {orders[name]}: run `triage train --policy POLICY` again"
            )
        if out[name].needs_embedding and policy.classifier is None:
            problems.append(
                f"cascade.tiers.{name}: its learned gate reads the question's embedding: the policy needs a classifier"
            )
        if margins.get(name) is not None and (out[name].after is None or policy.classifier is None):
            problems.append(
                f"cascade.tiers.{name}: escalation_margin compares with the last tier's record on the nearest "
                "questions: it needs a classifier, and a gate fitted with embeddings (`triage train` on such a policy)"
            )
    if problems:
        raise PolicyInvalid(problems)
    return out


def _budget(policy: Policy) -> EscalationBudget | None:
    """A fresh controller per policy (a reload starts it again at the policy's own thresholds)."""
    c = policy.cascade
    if c is None or c.escalation_budget is None:
        return None
    return EscalationBudget(c.escalation_budget, c.budget_step, c.budget_max_shift, c.budget_floor, c.budget_window)


def _recall(policy: Policy, previous: Runtime | None) -> Memory | None:
    """The cascade's memory: the previous runtime's where its spec is unchanged (a reload keeps what
    the last tier answered), else a new one."""
    spec = policy.cascade.memory if policy.cascade is not None else None
    if spec is None:
        return None
    old = previous.policy.cascade if previous is not None else None
    kept = old.memory.model_copy(update={"shared": spec.shared}) if old is not None and old.memory else None
    if previous is not None and previous.recall is not None and kept == spec:  # sharing or not: the same ring
        return previous.recall
    return Memory(spec.size)
