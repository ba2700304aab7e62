"""The prompts a tier sends, the pure part: a scorer's prompt and options from its templates, a
model tier's chat request with the engine's constrained decoding, the labels' regex and grammar.
The gateway's tiers (``gateway.service.tier_answers``) and the eval's (``eval.tier_runs``) both build them here."""

from __future__ import annotations

import json
import re
from typing import Any

from policies.answers import labels_for
from policies.cascade import Question
from policies.tiers import ModelTier, ScorerTier

Body = dict[str, Any]


def scorer_prompt(tier: ScorerTier, q: Question) -> tuple[str, list[str]]:
    t = tier.templates
    context = t.context.format(context=q.context) if q.context else ""
    lo, hi = q.scale if q.scale is not None else (0, 0)
    template = {"choice": t.choice, "yes_no": t.yes_no, "score": t.score}[q.type]
    prompt = template.format(context=context, question=q.question, min=lo, max=hi)
    return prompt, [t.option.format(option=o) for o in q.options]


def model_messages(q: Question) -> tuple[list[Body], tuple[str, ...]]:
    """The chat messages a generating model is asked, and the labels its answer is read as."""
    context = f"{q.context}\n\n" if q.context else ""
    if q.numeric:
        text = (
            f"{context}{q.question}\n\nWork it out step by step, then give the final answer as a number "
            "on the last line, after 'Answer:'."
        )
        return [{"role": "user", "content": text}], ()
    labels = labels_for(q.type, q.options)
    if q.type == "choice":
        listed = "\n".join(f"{label}. {o}" for label, o in zip(labels, q.options, strict=True))
        kind = "letter" if labels[0] == "A" else "number"
        text = (
            f"{context}Question: {q.question}\n\nOptions:\n{listed}\n\n"
            f"Answer with the {kind} of the correct option only."
        )
    elif q.type == "yes_no":
        text = f"{context}Question: {q.question}\n\nAnswer with yes or no only."
    else:
        lo, hi = q.scale or (0, 0)
        text = f"{context}Question: {q.question}\n\nAnswer with one whole number from {lo} to {hi} only."
    return [{"role": "user", "content": text}], labels


def model_body(tier: ModelTier, q: Question) -> tuple[Body, tuple[str, ...]]:
    """The chat request a model tier sends, with the engine's constrained decoding where set."""
    messages, labels = model_messages(q)
    body: Body = {
        "model": tier.model,
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": tier.numeric_max_tokens if q.numeric else tier.max_tokens,
    }
    if q.numeric:
        return body, labels
    if tier.logprobs:
        body.update(logprobs=True, top_logprobs=20)
    if tier.constrain == "guided_choice":
        body["guided_choice"] = list(labels)
    elif tier.constrain == "structured_outputs":  # vLLM: a scale as a pattern of its values, the rest a choice
        body["structured_outputs"] = {"regex": labels_regex(labels)} if q.type == "score" else {"choice": list(labels)}
    elif tier.constrain == "regex":
        body["regex"] = labels_regex(labels)
    elif tier.constrain == "grammar":  # GBNF: the labels only, so the answer is always one of them
        body["grammar"] = labels_grammar(labels)
    return body, labels


def labels_regex(labels: tuple[str, ...]) -> str:
    """A regular expression whose only matches are the labels."""
    return "(" + "|".join(re.escape(label) for label in labels) + ")"


def labels_grammar(labels: tuple[str, ...]) -> str:
    """A GBNF grammar (llama.cpp's) whose only sentences are the labels."""
    return "root ::= " + " | ".join(json.dumps(label, ensure_ascii=False) for label in labels)
