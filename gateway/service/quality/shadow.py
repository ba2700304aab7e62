"""What the quality watch records of an answered request, and how its shadow check asks the top.

- A typed decision (``decided``): answered by a tier of the cascade; the top is the cascade's last
  tier (a model tier), asked alone for the same question; the two agree when they give the same
  option (or number).
- An answer of a routed virtual model (``routed``): the top is its reference candidate (the
  shadow spec's, else the dearest), asked the same body; the two agree when their texts are the
  same, or the encoder reads them as the same (the semantic cache's rule: cosine at least 0.95).
  A streamed answer is recorded but not checked (its text is not kept here).

Either check runs off the request's path (:class:`gateway.service.quality.watch.Watch`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from backends.base import Body, Kind
from gateway.service import decisions, pipeline, recall, tier_answers
from gateway.service import job as jobs
from gateway.service.cache import response as response_cache
from gateway.service.cache import semantic as semantic_cache
from gateway.service.context import Context
from gateway.service.dispatch import Served
from gateway.service.keys import quotas
from gateway.service.quality import watch
from gateway.state.quality import Record
from policies import quality, spend
from policies.cascade import Ask, Decision, Question, read
from policies.fit import Shape
from policies.plans import ChainPlan, EncoderPlan, resolve
from policies.response_cache import last_user_text
from policies.schema import RoutedModel
from policies.tiers import ModelTier

if TYPE_CHECKING:
    from gateway.service.runtime import Runtime
    from gateway.service.tier_answers import ServeChat

CASCADE = "cascade"  # the model name typed decisions are recorded under (a policy has one cascade)
ANSWER_CHARS = 2000  # what of an open answer is embedded to compare it


def _owner(ctx: Context) -> str | None:
    return ctx.key.sha256 if ctx.key is not None else None


def decided(rt: Runtime, w: watch.Watch, q: Question, d: Decision, ctx: Context, serve_chat: ServeChat) -> None:
    """Record a typed decision; check it against the top tier when sampled."""
    spec = rt.policy.cascade
    assert spec is not None, "a decision was made: the policy has a cascade"
    last = spec.tiers[-1]
    top = d.tier == last.name
    cost = sum(c for *_, c in spend.decision_charges(rt.policy.models, d))
    shown = quality.question_doc(q.type, q.question, q.options, q.context) if rt.policy.logging.log_prompts else None
    record = Record(ctx.request_id, time.time(), _owner(ctx), CASCADE, "cascade", d.tier, top, q.type, cost, shown)
    w.note(record)
    if spec.shadow is None or top or d.cached or not isinstance(last, ModelTier):
        return
    chars = len(q.question) + len(q.context or "") + sum(len(o) for o in q.options) + 200  # the tier's wording
    upper = watch.reserve(
        rt.policy.models.get(last.model), chars, last.numeric_max_tokens if q.numeric else max(last.max_tokens, 64)
    )
    tier = last

    async def ask_top() -> tuple[str, float]:
        gate = decisions.gates(spec, None, rt.judges)[-1]  # how the top's answer is read
        answer = await tier_answers.answer(
            rt, tier, Ask(tier.name, tier.type, q), watch.ctx_for(ctx.request_id), serve_chat
        )
        if answer.error is not None or answer.skipped:
            raise RuntimeError(answer.error or "the top tier cannot take the question")
        said = read(q, gate, answer).answer
        if rt.recall is not None and not q.numeric:  # the cheap tiers learn from the check too
            embedding = await tier_answers.question_embedding(rt, q, (), always=True)
            if embedding is not None:
                recall.keep(rt.recall, rt.memory_feed, embedding, q, said)
        return said, quotas.price(rt, answer.model, answer.usage)

    async def same(a: str, b: str) -> bool:
        return a == b

    w.check(CASCADE, spec.shadow, upper, record, d.answer, ask_top, same)


def routed(
    rt: Runtime, w: watch.Watch, plan: EncoderPlan, kind: Kind, body: Body, served: Served, ctx: Context, shape: Shape
) -> None:
    """Record a routed model's answer; check it against the reference candidate when sampled."""
    vm = plan.model
    assert isinstance(vm, RoutedModel)
    ref = vm.shadow.reference if vm.shadow is not None and vm.shadow.reference else None
    ref = ref or spend.dearest(rt.policy.models, vm.routes())
    whole = served.completion.body if served.completion is not None else None
    cost = quotas.price(rt, served.model, whole.get("usage")) if whole is not None else 0.0
    shown = last_user_text(body) if rt.policy.logging.log_prompts else None
    top = served.model == ref
    record = Record(ctx.request_id, time.time(), _owner(ctx), plan.name, "routed", served.model, top, "", cost, shown)
    w.note(record)
    if vm.shadow is None or top or whole is None:
        return
    kept = response_cache.answer_text(whole)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or vm.output_tokens * 4
    upper = watch.reserve(rt.policy.models.get(ref), watch.body_chars(body), int(max_tokens))
    asked = {**body, "model": ref, "stream": False}
    asked.pop("stream_options", None)  # only a stream may carry them
    found = resolve(rt.policy, ref)
    assert isinstance(found, ChainPlan), "validated: a routed model's candidates are models"
    plan_top: ChainPlan = found

    async def ask_top() -> tuple[str, float]:
        fresh = await pipeline.serve_plan(
            rt, jobs.internal(kind, asked, plan_top, shape), watch.ctx_for(ctx.request_id)
        )
        assert fresh.completion is not None, "asked whole"
        return response_cache.answer_text(fresh.completion.body), quotas.price(
            rt, fresh.model, fresh.completion.body.get("usage")
        )

    w.check(plan.name, vm.shadow, upper, record, kept, ask_top, texts_agree(rt))


def texts_agree(rt: Runtime) -> Callable[[str, str], Awaitable[bool]]:
    """Whether two open answers agree: the same text, or texts the encoder reads as the same (the
    semantic cache's rule); without an encoder, only the same text."""
    encoding = rt.encoding

    async def same(a: str, b: str) -> bool:
        if a.strip() == b.strip():
            return True
        if encoding is None:
            return False
        (ea, _), (eb, _) = [await encoding.embedder.embed(t[:ANSWER_CHARS]) for t in (a, b)]
        return semantic_cache.agree(ea, eb)

    return same
