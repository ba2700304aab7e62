"""The encoder tier in the request path: embed the prompt (micro-batched), read the heads,
decide the route of a semantic virtual model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import structlog

from backends.base import Body, Kind
from backends.probe import ProbeBackend
from classifiers.batching import MicroBatcher
from classifiers.encoder import Reading
from classifiers.quality import QualityHead, joint_features, probe_head_name, quality_head_name
from classifiers.service import Classifier, artifacts_dir
from gateway.service.messages import text as message_text
from gateway.service.readings import KEPT, turns
from policies import routed
from policies.errors import NotReady, TriageError, UpstreamError
from policies.routed import candidate_label, probe_source
from policies.schema import ClassifierSpec, Policy, RoutedModel, RouterProbe, SemanticModel
from policies.semantic import Route, choose_route, choose_route_turns, is_follow_up

log = structlog.get_logger("triage.router")
ReasoningRouter = tuple[Policy, RoutedModel, QualityHead]


@dataclass
class Encoding:
    """The loaded classifier and the batcher that feeds it."""

    config: ClassifierSpec
    classifier: Classifier
    batcher: MicroBatcher[str, Reading]
    signature: tuple[tuple[str, int], ...]  # the artifacts as loaded: retrained heads differ
    embedder: MicroBatcher[str, tuple[np.ndarray, int]]  # /v1/embeddings: the vector only, and its tokens

    @classmethod
    async def load(cls, config: ClassifierSpec, policy_dir: Path) -> Encoding:
        signature = artifacts_signature(config, policy_dir)
        clf = await asyncio.to_thread(Classifier.load, config, policy_dir)
        e = config.encoder
        batcher: MicroBatcher[str, Reading] = MicroBatcher(
            clf.encoder.read, max_batch=e.batch_max_size, max_wait_ms=e.batch_max_wait_ms
        )
        embedder: MicroBatcher[str, tuple[np.ndarray, int]] = MicroBatcher(
            clf.encoder.embed_counted,
            max_batch=e.batch_max_size,
            max_wait_ms=e.batch_max_wait_ms,
            thread_name="triage-embeddings",
        )
        return cls(config, clf, batcher, signature, embedder)

    async def close(self) -> None:
        await self.batcher.aclose()
        await self.embedder.aclose()

    async def read(self, text: str) -> Reading:
        """One prompt's reading (micro-batched); within :func:`readings_kept` (a request with
        guardrails), a text the request read before is not read again: the jailbreak guardrail reads
        the last user turn before routing, and the router reuses it."""
        kept = KEPT.get()
        if kept is not None and (found := kept.get(text)) is not None:
            return found
        reading = await self.batcher.embed(text)
        if kept is not None:
            kept[text] = reading
        return reading

    async def route(
        self, vm: SemanticModel, kind: Kind, body: Body, reasoning_router: ReasoningRouter | None = None
    ) -> Route:
        """The semantic model's route; with ``reasoning: {mode: router}``, its reasoning switch is the
        reasoning router's choice for the last turn (``reasoning_router``: the policy, that routed
        model and its quality head)."""
        last, earlier = turns(kind, body)
        if is_follow_up(vm, last, len(earlier)):
            texts = [last, "\n".join(earlier)]
            readings = await asyncio.gather(*(self.batcher.embed(t) for t in texts))
            (own, own_fam), (prev, prev_fam) = self.classifier.classify_readings(list(readings), texts)
            route = choose_route_turns(
                vm,
                (own, own_fam.in_distribution, own_fam.readable),
                (prev, prev_fam.in_distribution, prev_fam.readable),
            )
            reading = readings[0]
        else:
            reading = await self.read(last)
            [(heads, fam)] = self.classifier.classify_readings([reading], [last])
            route = choose_route(vm, heads, fam.in_distribution, fam.readable)
        if route.reasoning_by_router and reasoning_router is not None:
            policy, rvm, head = reasoning_router
            choice = routed.choose_candidate(
                policy, rvm, head.proba(reading.vector)[0], input_tokens(kind, body), head.dev_accuracy
            )
            route = replace(route, reasoning=choice.reasoning == "on", quality=choice)
        return route

    async def route_quality(
        self,
        policy: Policy,
        vm: RoutedModel,
        head: QualityHead,
        kind: Kind,
        body: Body,
        barred: Sequence[str | None] | None = None,
        probe: Probe | None = None,
    ) -> Route:
        """The learned router's route: quality predicted from the last user turn, cost from the whole
        prompt; ``barred``: per candidate, why it cannot take the request (None: it can); ``probe``:
        the routed model's difficulty probe, asked where the heads' choice is close."""
        last, _ = turns(kind, body)
        reading, tokens = await self.read(last), input_tokens(kind, body)
        if probe is None:
            return quality_route(policy, vm, head, reading, tokens, barred)
        return await probed_route(policy, vm, head, reading, last, tokens, barred, probe)


@dataclass(frozen=True)
class Probe:
    """A routed model's difficulty probe as served: its policy entry, its backend and its head (on
    MiniLM's embedding and the probe's reading side by side)."""

    spec: RouterProbe
    backend: ProbeBackend
    head: QualityHead


async def probed_route(
    policy: Policy,
    vm: RoutedModel,
    head: QualityHead,
    reading: Reading,
    text: str,
    tokens: int,
    barred: Sequence[str | None] | None,
    probe: Probe,
) -> Route:
    """The learned router's route with its probe: where the first head's two best candidates are
    within the probe's margin, the probe reads ``text`` (one it cannot read, e.g. an empty one, is
    not sent) and its head predicts instead; a reading that fails or is late is logged and the first
    head's choice stands. The reading's cost is counted in the route's expected cost."""
    out = _barred(barred)
    q = head.proba(reading.vector)[0]
    if not routed.close_call(policy, vm, q, tokens, head.dev_accuracy, out):
        return _route(policy, vm, q, head.dev_accuracy, tokens, barred, "not needed")
    if not probe.backend.can_read(text):
        return _route(policy, vm, q, head.dev_accuracy, tokens, barred, "not readable")
    t0 = time.perf_counter()
    try:
        hidden, _ = await probe.backend.read(text, probe.spec.timeout_s)
        if len(hidden) + len(reading.vector) != probe.head.dim:  # another file of the same name
            raise UpstreamError(
                f"the probe read {len(hidden)} numbers, its head was fitted on {probe.head.dim - len(reading.vector)}: "
                "retrain it with `triage train --policy POLICY --routers-only`"
            )
    except TriageError as exc:  # the probe is an aid: without it the first head decides
        ms = (time.perf_counter() - t0) * 1000
        log.warning("probe_failed", backend=probe.spec.backend, error=exc.message, latency_ms=round(ms, 1))
        return _route(policy, vm, q, head.dev_accuracy, tokens, barred, "failed", ms)
    ms = (time.perf_counter() - t0) * 1000
    q = probe.head.proba(joint_features(reading.vector, hidden))[0]
    return _route(policy, vm, q, probe.head.dev_accuracy, tokens, barred, "read", ms, probe.spec.cost_per_call)


def load_quality(
    policy: Policy, policy_dir: Path, dim: int
) -> tuple[dict[str, QualityHead], dict[str, QualityHead], list[str]]:
    """The quality heads of every routed virtual model, the second heads of those with a probe,
    and what is wrong with them (missing, another encoder width, other candidates than the
    policy's, a probe head fitted on another probe's readings)."""
    heads: dict[str, QualityHead] = {}
    probes: dict[str, QualityHead] = {}
    problems: list[str] = []
    assert policy.classifier is not None
    root = artifacts_dir(policy.classifier, policy_dir)
    retrain = "retrain it with `triage train --policy POLICY --routers-only`"
    for name, vm in policy.virtual_models.items():
        if not isinstance(vm, RoutedModel):
            continue
        try:
            head = QualityHead.load(root, quality_head_name(name))
            second = QualityHead.load(root, probe_head_name(name)) if vm.probe is not None else None
        except NotReady as exc:
            problems.append(f"virtual_models.{name}: {exc.message}")
            continue
        want = tuple(c.column for c in vm.candidates)
        if head.models != want or head.dim != dim:
            problems.append(
                f"virtual_models.{name}: its quality head was trained for {', '.join(head.models)} on "
                f"{head.dim}-d embeddings, the policy routes {', '.join(want)} on {dim}-d: {retrain}"
            )
            continue
        heads[name] = head
        if second is not None:
            source = probe_source(policy, vm)
            if second.models != want or second.dim <= dim or second.meta.get("probe") != source:
                problems.append(
                    f"virtual_models.{name}.probe: its head was fitted for {', '.join(second.models)} on the "
                    f"readings of {second.meta.get('probe')}, the policy probes {', '.join(want)} with {source}: "
                    f"{retrain}"
                )
                continue
            probes[name] = second
    return heads, probes, problems


def quality_route(
    policy: Policy,
    vm: RoutedModel,
    head: QualityHead,
    reading: Reading,
    tokens: int,
    barred: Sequence[str | None] | None = None,
) -> Route:
    """The learned router's route for one prompt's reading, among the candidates not ``barred``."""
    return _route(policy, vm, head.proba(reading.vector)[0], head.dev_accuracy, tokens, barred)


def _barred(barred: Sequence[str | None] | None) -> list[int]:
    return [i for i, why in enumerate(barred or ()) if why is not None]


def _route(
    policy: Policy,
    vm: RoutedModel,
    quality: np.ndarray,
    accuracy: np.ndarray | None,
    tokens: int,
    barred: Sequence[str | None] | None,
    probe: routed.ProbeOutcome | None = None,
    probe_ms: float | None = None,
    probe_cost: float = 0.0,
) -> Route:
    """The route of a routed model's choice on these predictions (and what its probe did)."""
    out = _barred(barred)
    choice = routed.choose_candidate(policy, vm, quality, tokens, accuracy, out)
    if probe is not None:
        choice = replace(choice, probe=probe, probe_ms=probe_ms, cost=choice.cost + probe_cost)
    skipped = tuple(
        (candidate_label(vm.candidates[i].model, vm.candidates[i].reasoning), str((barred or [])[i])) for i in out
    )
    return Route(
        choice.model,
        choice.reasoning == "on",
        "quality",
        None,
        choice.quality,
        None,
        quality=choice,
        apply_reasoning=choice.reasoning is not None,
        skipped=skipped,
    )


def artifacts_signature(config: ClassifierSpec, policy_dir: Path) -> tuple[tuple[str, int], ...]:
    root = artifacts_dir(config, policy_dir)
    files = sorted([*root.glob("*.npz"), *root.glob("*.json")]) if root.is_dir() else []
    return tuple((f.name, f.stat().st_mtime_ns) for f in files)


def input_tokens(kind: Kind, body: Body) -> int:
    """The prompt's tokens, for the expected cost: about four characters a token, every message."""
    if kind == "completion":
        prompt = body.get("prompt")
        chars = len(prompt) if isinstance(prompt, str) else sum(len(p) for p in prompt or () if isinstance(p, str))
    else:
        chars = sum(len(message_text(m.get("content"))) for m in body.get("messages") or ())
    return max(1, chars // 4)
