"""The encoder tier in the request path: embed the prompt (micro-batched), read the heads,
decide the route of a semantic virtual model."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from backends.base import Body, Kind
from classifiers.batching import MicroBatcher
from classifiers.encoder import Reading
from classifiers.quality import QualityHead, quality_head_name
from classifiers.service import Classifier, artifacts_dir
from gateway.service.messages import text as message_text
from policies import routed
from policies.errors import NotReady
from policies.routed import candidate_label
from policies.schema import ClassifierSpec, Policy, RoutedModel, SemanticModel
from policies.semantic import Route, choose_route, choose_route_turns, is_follow_up

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

    async def route(
        self, vm: SemanticModel, kind: Kind, body: Body, reasoning_router: ReasoningRouter | None = None
    ) -> Route:
        """The semantic model's route; with ``reasoning: {mode: router}``, its reasoning switch is the
        reasoning router's choice for the last turn (``reasoning_router``: the policy, that routed
        model and its quality head)."""
        last, earlier = _turns(kind, body)
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
            reading = await self.batcher.embed(last)
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
    ) -> Route:
        """The learned router's route: quality predicted from the last user turn, cost from the whole
        prompt; ``barred``: per candidate, why it cannot take the request (None: it can)."""
        last, _ = _turns(kind, body)
        return quality_route(policy, vm, head, await self.batcher.embed(last), input_tokens(kind, body), barred)


def load_quality(policy: Policy, policy_dir: Path, dim: int) -> tuple[dict[str, QualityHead], list[str]]:
    """The quality heads of every routed virtual model, and what is wrong with them (missing,
    another encoder width, other candidates than the policy's)."""
    heads: dict[str, QualityHead] = {}
    problems: list[str] = []
    assert policy.classifier is not None
    root = artifacts_dir(policy.classifier, policy_dir)
    for name, vm in policy.virtual_models.items():
        if not isinstance(vm, RoutedModel):
            continue
        try:
            head = QualityHead.load(root, quality_head_name(name))
        except NotReady as exc:
            problems.append(f"virtual_models.{name}: {exc.message}")
            continue
        want = tuple(c.column for c in vm.candidates)
        if head.models != want or head.dim != dim:
            problems.append(
                f"virtual_models.{name}: its quality head was trained for {', '.join(head.models)} on "
                f"{head.dim}-d embeddings, the policy routes {', '.join(want)} on {dim}-d: retrain it "
                "with `triage train --policy POLICY`"
            )
            continue
        heads[name] = head
    return heads, problems


def quality_route(
    policy: Policy,
    vm: RoutedModel,
    head: QualityHead,
    reading: Reading,
    tokens: int,
    barred: Sequence[str | None] | None = None,
) -> Route:
    """The learned router's route for one prompt's reading, among the candidates not ``barred``."""
    out = [i for i, why in enumerate(barred or ()) if why is not None]
    choice = routed.choose_candidate(policy, vm, head.proba(reading.vector)[0], tokens, head.dev_accuracy, out)
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


def _turns(kind: Kind, body: Body) -> tuple[str, list[str]]:
    """The last user turn, and the earlier user turns (oldest first)."""
    if kind == "completion":
        prompt = body.get("prompt")
        return (prompt if isinstance(prompt, str) else " ".join(p for p in prompt or () if isinstance(p, str))), []
    users = [message_text(m.get("content")) for m in body.get("messages") or () if m.get("role") == "user"]
    if not users:
        return "", []
    return users[-1], users[:-1]
