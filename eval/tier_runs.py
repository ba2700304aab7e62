"""How each kind of tier answers a labeled row offline: the encoder's option scorer, the GGUF
scorer (the same prompts as the gateway), and a recorded tier replaying real models' answers
from ``model_labels`` (MMLU-Pro's 29 models by predicted letter; RouteLLM's GPT-4 and Mixtral by
right/wrong, where a wrong answer stands as the first option that is not the gold one)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from eval.tier_outputs import Row, read_jsonl
from policies.cascade import TierAnswer
from policies.schema import Policy
from policies.tiers import ScorerTier

if TYPE_CHECKING:
    from classifiers.service import Classifier

Compute = Callable[[Row], TierAnswer]


def _logs(probs: list[float]) -> tuple[float, ...]:
    return tuple(math.log(max(p, 1e-12)) for p in probs)


def encoder(policy: Policy, policy_dir: Path, clf: Classifier | None = None) -> tuple[Compute, str]:
    """The encoder tier's answers, and a fingerprint of its trained option head (for the cache key);
    ``clf``: the policy's classifier where the caller has loaded it already."""
    import hashlib

    from classifiers.options import OPTIONS, question_text
    from classifiers.service import Classifier, artifacts_dir

    assert policy.classifier is not None
    clf = clf if clf is not None else Classifier.load(policy.classifier, policy_dir)
    head = clf.options
    weights = artifacts_dir(policy.classifier, policy_dir) / f"{OPTIONS}.npz"
    fingerprint = hashlib.sha1(weights.read_bytes()).hexdigest()[:10] if weights.is_file() else "none"

    def compute(row: Row) -> TierAnswer:
        q = row.question
        if q.numeric:
            return TierAnswer(skipped=True, error="a numeric answer needs generation")
        if q.task is not None:  # a task's question: its own head, as the gateway's encoder tier answers it
            task = clf.heads.get(q.task)
            if task is None or any(o not in task.classes for o in q.options):
                return TierAnswer(skipped=True, error=f"no head for task '{q.task}' with these labels")
            by_label = dict(
                zip(task.classes, task.proba(clf.encoder.embed([question_text(q.question, q.context)]))[0], strict=True)
            )
            return TierAnswer(scores=_logs([float(by_label[o]) for o in q.options]))
        if head is None or q.type not in head.types:
            return TierAnswer(skipped=True, error=f"no option scorer for {q.type} questions")
        vecs = clf.encoder.embed([question_text(q.question, q.context), *q.options])
        return TierAnswer(scores=_logs(list(head.proba(q.type, vecs[0], vecs[1:]))))

    return compute, fingerprint


def scorer(policy: Policy, tier: ScorerTier) -> Compute:
    from backends import gguf
    from backends.lettered import ChatScorer, LetteredInputError, in_order, mean_of_orders, orders_for
    from backends.logprob import OptionScores, PromptTooLong
    from policies.prompts import scorer_prompt

    spec = policy.backends[tier.backend]
    path = gguf.model_file(spec.gguf.package, spec.gguf.path)  # type: ignore[union-attr]
    engine = ChatScorer(path, spec.n_ctx, spec.n_threads, spec.n_batch)  # type: ignore[union-attr]

    def compute(row: Row) -> TierAnswer:
        if row.question.numeric:
            return TierAnswer(skipped=True, error="a numeric answer needs generation")
        got: OptionScores
        try:
            if tier.mode != "cloze":
                got = engine.score_question(row.question, tier.reasoning_budget)
            else:
                got = engine.score(*scorer_prompt(tier, row.question))
        except (PromptTooLong, LetteredInputError) as exc:
            return TierAnswer(error=str(exc))
        values = got.logprobs
        if tier.length_norm == "tokens":
            values = tuple(lp / n for lp, n in zip(values, got.tokens, strict=True))
        read = got.prompt_tokens - got.reused_tokens
        orders = orders_for(row.question, tier.orders)  # as the gateway's tier
        readings = [(orders[0], values)]
        try:
            for order in orders[1:]:
                other = engine.score_question(in_order(row.question, order), tier.reasoning_budget)
                readings.append((order, other.logprobs))
                read += other.prompt_tokens - other.reused_tokens
        except (PromptTooLong, LetteredInputError) as exc:
            return TierAnswer(error=str(exc))
        if len(readings) > 1:
            values = mean_of_orders(readings)
        return TierAnswer(scores=values, usage={"prompt_tokens": read})

    return compute


def recorded(data_dir: Path, model: str) -> dict[str, Compute]:
    """Per typed source, how ``model``'s recorded answers read; sources it has none for are absent."""
    mmlu_pro = {
        r["question_id"]: (r["pred"].get(model), r["correct"].get(model))
        for _, r in read_jsonl(data_dir / "model_labels" / "mmlu_pro_models.jsonl.gz")
        if model in r["correct"]
    }
    routellm = {
        r["question_id"]: r["correct"][model]
        for _, r in read_jsonl(data_dir / "model_labels" / "routellm_mmlu.jsonl.gz")
        if r.get("question_id") and model in r["correct"]
    }
    out: dict[str, Compute] = {}

    def letter(row: Row) -> TierAnswer:
        pred, correct = mmlu_pro.get(row.id, (None, None))
        if correct is None:
            return TierAnswer(error=f"{model} has no output for this question")
        index = ord(pred) - ord("A") if isinstance(pred, str) and len(pred) == 1 else -1
        if not 0 <= index < len(row.question.options):
            return TierAnswer(error=f"{model}'s answer could not be parsed")
        return TierAnswer(scores=_one_hot(len(row.question.options), index))

    def right_or_wrong(row: Row) -> TierAnswer:
        correct = routellm.get(row.id)
        if correct is None:
            return TierAnswer(error=f"no recording of {model} for this question")
        gold = row.question.options.index(row.answer)
        index = gold if correct else next(i for i in range(len(row.question.options)) if i != gold)
        return TierAnswer(scores=_one_hot(len(row.question.options), index))

    if mmlu_pro:
        out["mmlu_pro"] = letter
    gsm8k = {
        r["question_id"]: r["correct"][model]
        for _, r in read_jsonl(data_dir / "model_labels" / "routellm_gsm8k.jsonl")
        if model in r["correct"]
    }

    def number(row: Row) -> TierAnswer:
        correct = gsm8k.get(row.id)
        if correct is None:
            return TierAnswer(error=f"no recording of {model} for this question")
        return TierAnswer(text=row.answer if correct else "wrong", confidence=1.0)  # only right/wrong is recorded

    if routellm:  # its MMLU-Pro joins were asked with MMLU's 4 options, not MMLU-Pro's 10: not used there
        out["mmlu_redux"] = right_or_wrong
    if gsm8k:
        out["gsm8k"] = number
    return out


def _one_hot(n: int, index: int) -> tuple[float, ...]:
    return tuple(0.0 if i == index else -30.0 for i in range(n))
