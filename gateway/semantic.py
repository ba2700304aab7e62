"""The encoder tier in the request path: embed the prompt (micro-batched), read the heads,
decide the route of a semantic virtual model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from backends.base import Body, Kind
from classifiers.batching import MicroBatcher
from classifiers.encoder import Reading
from classifiers.service import Classifier, artifacts_dir
from gateway.messages import text as message_text
from policies.schema import Classifier as ClassifierConfig
from policies.schema import SemanticModel
from policies.semantic import Route, decide, decide_turns, is_follow_up


@dataclass
class Encoding:
    """The loaded classifier and the batcher that feeds it."""

    config: ClassifierConfig
    classifier: Classifier
    batcher: MicroBatcher[str, Reading]
    signature: tuple[tuple[str, int], ...]  # the artifacts as loaded: retrained heads differ

    @classmethod
    async def load(cls, config: ClassifierConfig, policy_dir: Path) -> Encoding:
        signature = artifacts_signature(config, policy_dir)
        clf = await asyncio.to_thread(Classifier.load, config, policy_dir)
        e = config.encoder
        batcher: MicroBatcher[str, Reading] = MicroBatcher(clf.encoder.read, max_batch=e.batch_max_size,
                                                  max_wait_ms=e.batch_max_wait_ms)
        return cls(config, clf, batcher, signature)

    async def close(self) -> None:
        await self.batcher.aclose()

    async def route(self, vm: SemanticModel, kind: Kind, body: Body) -> Route:
        last, earlier = _turns(kind, body)
        if is_follow_up(vm, last, len(earlier)):
            texts = [last, "\n".join(earlier)]
            readings = await asyncio.gather(*(self.batcher.embed(t) for t in texts))
            (own, own_fam), (prev, prev_fam) = self.classifier.classify_readings(list(readings), texts)
            return decide_turns(vm, (own, own_fam.in_distribution, own_fam.readable),
                                (prev, prev_fam.in_distribution, prev_fam.readable))
        [(heads, fam)] = self.classifier.classify_readings([await self.batcher.embed(last)], [last])
        return decide(vm, heads, fam.in_distribution, fam.readable)


def artifacts_signature(config: ClassifierConfig, policy_dir: Path) -> tuple[tuple[str, int], ...]:
    root = artifacts_dir(config, policy_dir)
    files = sorted([*root.glob("*.npz"), *root.glob("*.json")]) if root.is_dir() else []
    return tuple((f.name, f.stat().st_mtime_ns) for f in files)


def _turns(kind: Kind, body: Body) -> tuple[str, list[str]]:
    """The last user turn, and the earlier user turns (oldest first)."""
    if kind == "completion":
        prompt = body.get("prompt")
        return (prompt if isinstance(prompt, str) else " ".join(p for p in prompt or () if isinstance(p, str))), []
    users = [message_text(m.get("content")) for m in body.get("messages") or () if m.get("role") == "user"]
    if not users:
        return "", []
    return users[-1], users[:-1]
