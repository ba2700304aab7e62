"""The cascade's tiers, live: each turns an :class:`Ask` into a :class:`TierAnswer`.

Any failure of a tier becomes an answer with ``error`` (the cascade escalates past it); a tier
that cannot take the question answers ``skipped``. Nothing here decides: that is
``policies.cascade``. A model tier's question is served through the port it is given
(:data:`ServeChat`, the service's own chat path), not by importing that path.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import numpy as np

from backends.base import Body
from backends.lettered import LetteredScores, in_order, mean_of_orders, orders_for
from backends.scorer import ScorerBackend
from gateway.service.context import Context
from gateway.service.dispatch import Served
from gateway.service.runtime import Runtime
from policies.answers import assumed_scores, extract_number, label_in_text, label_logprobs
from policies.cascade import Ask, Gate, Question, TierAnswer
from policies.errors import InvalidRequest, NothingFits, TriageError, UpstreamRejected
from policies.prompts import model_body, scorer_prompt
from policies.tiers import EncoderTier, ModelTier, ScorerTier, Tier

ServeChat = Callable[[Body, Context], Awaitable[Served]]  # a chat body served by its model's plan


async def answer(
    rt: Runtime,
    tier: Tier,
    ask: Ask,
    ctx: Context,
    serve_chat: ServeChat,
    embedding: np.ndarray | None = None,
) -> TierAnswer:
    """One tier's answer; ``embedding``: the question's, where the caller has it already."""
    t0 = time.perf_counter()
    ms = lambda: (time.perf_counter() - t0) * 1000  # noqa: E731
    try:
        async with asyncio.timeout(tier.timeout_s):
            if isinstance(tier, EncoderTier):
                result = await _encoder(rt, ask.question, embedding)
            elif isinstance(tier, ScorerTier):
                result = await _scorer(rt, tier, ask.question)
            else:
                result = await _model(rt, tier, ask.question, ctx, serve_chat)
    except TimeoutError:
        return TierAnswer(latency_ms=ms(), error=f"timed out after {tier.timeout_s:g}s")
    except InvalidRequest as exc:  # the tier cannot take this question (it does not fit): skipped, not failed
        if exc.code not in ("context_length_exceeded", "unsupported_request"):
            return TierAnswer(latency_ms=ms(), error=exc.message)
        return TierAnswer(latency_ms=ms(), skipped=True, error=exc.message)
    except TriageError as exc:
        return TierAnswer(latency_ms=ms(), error=exc.message)
    if isinstance(result, str):
        return TierAnswer(latency_ms=ms(), skipped=True, error=result)
    return replace(result, latency_ms=ms())


async def question_embedding(
    rt: Runtime, q: Question, gates: Sequence[Gate], always: bool = False
) -> np.ndarray | None:
    """The question's embedding (context first, as the option scorer embeds it), where a learned
    gate reads it (or ``always``: the cascade's memory); one encoder call, shared with the encoder tier."""
    if rt.encoding is None or not (always or any(g.judge is not None and g.judge.uses_embedding for g in gates)):
        return None
    return (await rt.encoding.batcher.embed(_question_text(q))).vector


def _log(p: np.ndarray) -> tuple[float, ...]:
    return tuple(float(math.log(max(float(v), 1e-12))) for v in p)


async def _encoder(rt: Runtime, q: Question, embedding: np.ndarray | None = None) -> TierAnswer | str:
    enc = rt.encoding
    if enc is None:
        return "the policy has no classifier"
    if q.numeric:
        return "a numeric answer needs generation"
    clf = enc.classifier
    if q.task is not None:
        head = clf.heads.get(q.task)
        if head is None:
            return f"no head for task '{q.task}'"
        if any(o not in head.classes for o in q.options):
            return f"the options are not all labels of task '{q.task}'"
        vec = embedding if embedding is not None else (await enc.batcher.embed(_question_text(q))).vector
        by_label = dict(zip(head.classes, head.proba(vec[None, :])[0], strict=True))
        return TierAnswer(scores=_log(np.array([by_label[o] for o in q.options])))
    options = clf.options
    if options is None or q.type not in options.types:
        return f"no option scorer for {q.type} questions"
    texts = list(q.options) if embedding is not None else [_question_text(q), *q.options]
    readings = [r.vector for r in await asyncio.gather(*(enc.batcher.embed(t) for t in texts))]  # one batch
    vec = embedding if embedding is not None else readings.pop(0)
    probs = options.proba(q.type, vec, np.vstack(readings))
    return TierAnswer(scores=_log(probs))


def _question_text(q: Question) -> str:
    from classifiers.options import question_text

    return question_text(q.question, q.context)


async def _scorer(rt: Runtime, tier: ScorerTier, q: Question) -> TierAnswer | str:
    if q.numeric:
        return "a numeric answer needs generation"
    backend = rt.backends[tier.backend]
    assert isinstance(backend, ScorerBackend)
    started = time.perf_counter()
    if tier.mode != "cloze":  # labels read from the next token: one token each, no length norm to apply
        scores = await backend.score_question(q, tier.timeout_s, tier.reasoning_budget)
    else:
        prompt, options = scorer_prompt(tier, q)
        scores = await backend.score(prompt, options, tier.timeout_s)
    values = scores.logprobs
    if tier.length_norm == "tokens":
        values = tuple(lp / n for lp, n in zip(values, scores.tokens, strict=True))
    usage = {"prompt_tokens": scores.prompt_tokens, "cached_tokens": scores.reused_tokens}
    if isinstance(scores, LetteredScores) and scores.generated_tokens:
        usage["completion_tokens"] = scores.generated_tokens
    orders = orders_for(q, tier.orders)
    readings = [(orders[0], values)]
    for order in orders[1:]:  # the other orders of the options, in what the timeout leaves (the caller's bounds all)
        left = max(tier.timeout_s - (time.perf_counter() - started), 0.001)
        other = await backend.score_question(in_order(q, order), left, tier.reasoning_budget)
        readings.append((order, other.logprobs))
        usage["prompt_tokens"] += other.prompt_tokens
        usage["cached_tokens"] += other.reused_tokens
        if isinstance(other, LetteredScores) and other.generated_tokens:
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + other.generated_tokens
    if len(readings) > 1:
        values = mean_of_orders(readings)
    return TierAnswer(scores=values, usage=usage)


async def _model(rt: Runtime, tier: ModelTier, q: Question, ctx: Context, serve_chat: ServeChat) -> TierAnswer | str:
    body, labels = model_body(tier, q)
    try:
        served = await serve_chat(body, ctx)  # the tier model's plan: its chain, or the learned router's pick
    except NothingFits:
        raise
    except (InvalidRequest, UpstreamRejected):
        if not body.get("logprobs"):
            raise
        # an engine that refuses logprobs (llama-cpp-python without logits_all): ask again without,
        # and the answer counts with the tier's assumed confidence
        body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
        served = await serve_chat(body, ctx)
    assert served.completion is not None
    shown = rt.policy.logging.log_prompts  # model output in an error message only where prompts may be logged
    return replace(_read_model(tier, q, served.completion.body, labels, shown), model=served.model)


def _read_model(
    tier: ModelTier, q: Question, reply: Body, labels: tuple[str, ...], show_text: bool = False
) -> TierAnswer:
    """The answer in a model tier's reply: the number, or the option's log-probabilities."""
    usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else None
    try:
        choice = reply["choices"][0]
        text = choice["message"].get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        return TierAnswer(error="the model's reply has no message")
    if q.numeric:
        number = extract_number(text)
        if number is None:
            return TierAnswer(error="the model's answer holds no number", usage=usage)
        return TierAnswer(text=number, confidence=tier.assumed_confidence, usage=usage, assumed=True)
    content = ((choice.get("logprobs") or {}).get("content") or []) if isinstance(choice, dict) else []
    scores = label_logprobs(content, labels) if content else None
    if scores is None:
        index = label_in_text(text, labels)
        if index is None:
            said = f" {text[:40]!r}" if show_text else f" ({len(text)} characters)"
            return TierAnswer(error=f"the model's answer{said} names no option", usage=usage)
        return TierAnswer(
            scores=tuple(assumed_scores(len(labels), index, tier.assumed_confidence)), usage=usage, assumed=True
        )
    return TierAnswer(scores=tuple(scores), usage=usage)
