"""Lettered scoring, for instruct models: the options listed with letters (or yes/no, or a
scale's digits) in the model's own chat template, the answer read from the distribution of the
next token over the labels. One prefill, one position, no generation.

A label's probability is the mass of its single-token spellings (``A`` and `` A``; ``yes``,
``Yes``, `` yes``; ...), renormalised over the labels; ``label_mass`` says how much of the
next token's distribution fell on any label at all (a model that wants to start its answer with
"The" puts little there). The prompt is the pool tier's question text (``gateway.service.tier_answers``), so a
tier's answer means the same whichever engine reads it. A file without a chat template (a base
model, such as the packaged Gemma 3 270M) gets that text as plain text, followed by ``Answer:``.

Pure prompt building (:func:`lettered_prompt`) apart from the engine (:class:`ChatScorer`, an
:class:`~backends.logprob.OptionScorer` that also renders chat templates); callers serialise
access to the engine as for the option scorer.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from backends.logprob import OptionScorer, OptionScores, PromptTooLong
from policies.cascade import Question

LETTERS = string.ascii_uppercase
PROMPT_VERSION = "1"  # the question text below; change it when the text changes
REASONED_VERSION = "1"  # the reasoned ask and the answer cue below
ANSWER_CUE = "Answer:"
CUE_BYTES = ANSWER_CUE.encode()
ANSWER_ASK = "Give only the final answer, as briefly as possible, with no explanation."  # answer_steps


class LetteredInputError(ValueError):
    """A question lettered scoring cannot take (the caller's fault: a 400, or an escalation)."""


@dataclass(frozen=True)
class LetteredPrompt:
    messages: tuple[dict[str, str], ...]
    labels: tuple[str, ...]  # one per option, in the options' order


@dataclass(frozen=True)
class LetteredScores(OptionScores):
    label_mass: float  # P(the next token is any label's spelling), before renormalising
    generated_tokens: int = 0  # reasoned: the tokens the model wrote before its answer
    reasoning: str = ""  # reasoned: what it wrote


@dataclass(frozen=True)
class AnswerSteps:
    """How sure a model was at each token of its own short, greedy answer (:meth:`ChatScorer.answer_steps`)."""

    top: tuple[float, ...]  # per token written (and the step that ended it): the greedy token's probability
    second: tuple[float, ...]  # ... the runner-up's
    entropy: tuple[float, ...]  # ... the distribution's entropy over log of the vocabulary's size
    prompt_tokens: int
    ended: bool  # the model ended its turn within the limit


def labels_for(qtype: str, options: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """What the model answers with: yes/no; the digits of a scale within 0-9; else letters."""
    if len(options) < 2:
        raise LetteredInputError(f"lettered scoring needs at least 2 options, not {len(options)}")
    empty = [i + 1 for i, o in enumerate(options) if not o.strip()]
    if empty:
        raise LetteredInputError(f"option {empty[0]} is empty")
    if qtype == "yes_no":
        if tuple(o.lower() for o in options) != ("yes", "no"):
            raise LetteredInputError("a yes_no question's options are ('yes', 'no')")
        return ("yes", "no")
    if qtype == "score" and all(len(o) == 1 and o.isascii() and o.isdigit() for o in options):
        return tuple(options)
    if len(options) > len(LETTERS):
        raise LetteredInputError(f"lettered scoring takes at most {len(LETTERS)} options (A-Z), not {len(options)}")
    return tuple(LETTERS[: len(options)])


def lettered_prompt(q: Question, reasoned: bool = False) -> LetteredPrompt:
    """The chat messages for a question, and the label of each option; ``reasoned``: the model
    is asked to state the facts first and end with ``Answer:``."""
    if q.numeric:
        raise LetteredInputError("a numeric answer without a scale needs generation")
    if not q.question.strip():
        raise LetteredInputError("the question is empty")
    labels = labels_for(q.type, q.options)
    context = f"{q.context}\n\n" if q.context else ""
    if q.type == "yes_no":
        text, kind = f"{context}Question: {q.question}", "yes or no"
    elif labels[0].isascii() and labels[0].isdigit():
        lo, hi = q.scale or (int(labels[0]), int(labels[-1]))
        text, kind = f"{context}Question: {q.question}", f"one whole number from {lo} to {hi}"
    else:
        listed = "\n".join(f"{label}. {o}" for label, o in zip(labels, q.options, strict=True))
        text, kind = f"{context}Question: {q.question}\n\nOptions:\n{listed}", "the letter of the correct option"
    if reasoned:
        ask = f"First state the facts that decide it in one or two short sentences, then end with 'Answer:' and {kind}."
    else:
        ask = f"Answer with {kind} only."
    return LetteredPrompt(({"role": "user", "content": f"{text}\n\n{ask}"},), labels)


def orderings(n: int, k: int) -> tuple[tuple[int, ...], ...]:
    """Up to ``k`` distinct orders of ``n`` options for ``k`` readings (a tier's ``orders``), each the
    option shown at each position: as given, reversed, turned by half (the second half first), and
    that reversed. Four put each of four options at every position once; two options have two."""
    given = tuple(range(n))
    half = given[n // 2 :] + given[: n // 2]
    return tuple(dict.fromkeys((given, given[::-1], half, half[::-1])))[: max(k, 1)]


def orders_for(q: Question, k: int) -> tuple[tuple[int, ...], ...]:
    """The orders a question is read in: a choice question's :func:`orderings`; a yes/no question or a
    scale once, as given (their labels say what they are)."""
    return orderings(len(q.options), k if q.type == "choice" and len(q.options) >= 2 else 1)


def in_order(q: Question, order: tuple[int, ...]) -> Question:
    """The question with its options shown in ``order`` (one of :func:`orderings`)."""
    return replace(q, options=tuple(q.options[i] for i in order))


def in_given_order(order: tuple[int, ...], values: tuple[float, ...] | np.ndarray) -> np.ndarray:
    """A reading of the options shown in ``order`` (per position), per option in their given order."""
    out = np.empty(len(order), dtype=np.float64)
    out[list(order)] = values
    return out


def mean_of_orders(readings: list[tuple[tuple[int, ...], tuple[float, ...]]]) -> tuple[float, ...]:
    """Per option (in the question's order), the log of its mean probability over the readings, each
    an order and the log-probabilities read in it (per position). Each reading sums to one over the
    labels, so the mean does too."""
    rows = np.stack([in_given_order(order, logprobs) for order, logprobs in readings])
    m = rows.max(axis=0)
    return tuple(float(v) for v in m + np.log(np.exp(rows - m).mean(axis=0)))


def spellings(label: str) -> tuple[str, ...]:
    """The ways a model may write a label as its first answer token."""
    bases = (label, label.capitalize()) if label.islower() else (label,)  # never "a" for A
    return tuple(dict.fromkeys(f for base in bases for f in (base, " " + base)))


def _logsumexp(values: np.ndarray) -> float:
    m = float(values.max())
    return m + math.log(float(np.exp(values - m).sum()))


class ChatScorer(OptionScorer):
    """The option scorer, plus lettered scoring through the file's chat template."""

    def __init__(
        self, path: Path, n_ctx: int = 2048, n_threads: int = 1, n_batch: int = 512, model: Any = None
    ) -> None:
        super().__init__(path, n_ctx, n_threads, n_batch, model)
        self._formatter: Any = None  # llama-cpp-python's Jinja2ChatFormatter, once built
        self._templated: bool | None = None  # None: not looked up yet
        self._label_ids: dict[tuple[str, ...], list[list[int]]] = {}

    def chat_template(self) -> str | None:
        return self._model.metadata().get("tokenizer.chat_template")

    @property
    def templated(self) -> bool:
        """Whether the file has a chat template; one without (a base model) is prompted in plain text."""
        if self._templated is None:
            template = self.chat_template()
            self._templated = bool(template)
            if template:
                from llama_cpp.llama_chat_format import Jinja2ChatFormatter

                m = self._model
                text = lambda tok: m.token_get_text(tok) if tok != -1 else ""  # noqa: E731
                self._formatter = Jinja2ChatFormatter(
                    template, eos_token=text(m.token_eos()), bos_token=text(m.token_bos()), add_generation_prompt=True
                )
        return self._templated

    def render(self, messages: tuple[dict[str, str], ...]) -> str:
        """The prompt text the chat template makes of ``messages``, with the assistant's turn opened;
        without a template, the turns as plain text and then ``Answer:``."""
        if not self.templated:
            return "\n\n".join(m["content"] for m in messages) + "\nAnswer:"
        return str(self._formatter(messages=list(messages)).prompt)

    def prompt_tokens(self, messages: tuple[dict[str, str], ...]) -> list[int]:
        text = self.render(messages).encode("utf-8", "replace")
        if not self.templated:
            return list(self._model.tokenize(text, add_bos=True, special=False))
        # As llama-cpp-python's chat handler: the template writes any BOS itself; special tokens parsed.
        return list(self._model.tokenize(text, add_bos=False, special=True))

    def label_ids(self, labels: tuple[str, ...]) -> list[list[int]]:
        """Per label, the token ids of its single-token spellings; an error if a label has none
        or two labels share a token (the tokenizer cannot tell them apart)."""
        if labels in self._label_ids:
            return self._label_ids[labels]
        out: list[list[int]] = []
        for label in labels:
            toks = [self.tokenize(s, bos=False) for s in spellings(label)]
            ids = list(dict.fromkeys(t[0] for t in toks if len(t) == 1))
            if not ids:
                raise LetteredInputError(f"the model's tokenizer has no single token for the label {label!r}")
            out.append(ids)
        flat = [i for ids in out for i in ids]
        if len(flat) != len(set(flat)):
            raise LetteredInputError(f"the model's tokenizer cannot tell the labels {', '.join(labels)} apart")
        self._label_ids[labels] = out
        return out

    def score_lettered(self, prompt: LetteredPrompt) -> LetteredScores:
        """Log P(label) for each option's label, renormalised over the labels, from one prefill."""
        ids = self.label_ids(prompt.labels)
        tokens = self.prompt_tokens(prompt.messages)
        if not tokens or len(tokens) > self.n_ctx:
            raise PromptTooLong(
                f"the lettered prompt needs {len(tokens)} tokens, the scorer's context holds {self.n_ctx}"
            )
        row, reused = self._prefill(tokens)
        return self._read(row, ids, len(tokens), reused)

    def score_question(self, q: Question, reason_tokens: int = 0) -> LetteredScores:
        """Lettered scoring; with ``reason_tokens`` the model first writes up to that many tokens."""
        if reason_tokens:
            return self.score_reasoned(lettered_prompt(q, reasoned=True), reason_tokens)
        return self.score_lettered(lettered_prompt(q))

    def score_reasoned(self, prompt: LetteredPrompt, reason_tokens: int) -> LetteredScores:
        """The model writes (greedy) until its ``Answer:``, its end of turn or ``reason_tokens``;
        then ``Answer:`` is written for it and the labels are read from the next token."""
        ids = self.label_ids(prompt.labels)
        tokens = self.prompt_tokens(prompt.messages)
        if not tokens or len(tokens) + reason_tokens + 8 > self.n_ctx:
            raise PromptTooLong(
                f"the reasoned prompt needs {len(tokens)} tokens and {reason_tokens} to reason in, "
                f"the scorer's context holds {self.n_ctx}"
            )
        written, n = self._greedy(tokens, reason_tokens)
        reasoning = written.decode("utf-8", "replace").strip()
        cut = reasoning.rfind(ANSWER_CUE)
        if cut >= 0 and not reasoning[cut + len(ANSWER_CUE) :].strip():
            reasoning = reasoning[:cut].rstrip()  # its own cue, with no answer after it yet
        # " A" is one token for most tokenizers, " 5" is not for Qwen's: then the space is written too
        spaced = all(len(self.tokenize(" " + label, bos=False)) == 1 for label in prompt.labels)
        tail = self.tokenize(f"{reasoning}\n{ANSWER_CUE}" + ("" if spaced else " "), bos=False)
        full = tokens + tail
        if len(full) > self.n_ctx:
            raise PromptTooLong(
                f"the reasoned answer needs {len(full)} tokens, the scorer's context holds {self.n_ctx}"
            )
        row, reused = self._prefill(full)
        scores = self._read(row, ids, len(tokens), min(reused, len(tokens)))  # the prompt's; what it wrote apart
        return replace(scores, generated_tokens=n, reasoning=reasoning)

    def answer_steps(self, text: str, limit: int) -> AnswerSteps:
        """The model answers ``text`` (the user's turn, asked for the final answer only) greedily, up to
        ``limit`` tokens; at each step, how sure it was (the router's ``reading: answer``)."""
        tokens = self.prompt_tokens(({"role": "user", "content": f"{text.strip()}\n\n{ANSWER_ASK}"},))
        if not text.strip() or len(tokens) + limit > self.n_ctx:
            raise PromptTooLong(
                f"the answer needs {len(tokens)} prompt tokens and {limit} to answer in, "
                f"the scorer's context holds {self.n_ctx}"
            )
        row, _ = self._prefill(tokens)
        vocab, log_v = self._model.vocab, math.log(self.n_vocab)
        top: list[float] = []
        second: list[float] = []
        entropy: list[float] = []
        ended = False
        for _ in range(limit):
            if self.cancelled():
                break
            logp = row.astype(np.float64) - _logsumexp(row.astype(np.float64))
            two = np.argpartition(logp, -2)[-2:]
            tok = int(two[np.argmax(logp[two])])
            p = np.exp(logp)
            top.append(float(p[tok]))
            second.append(float(p[two].min()))
            entropy.append(float(-(p * logp).sum() / log_v))
            if self._lib.llama_vocab_is_eog(vocab, tok):
                ended = True
                break
            row = self._step(tok)
        return AnswerSteps(tuple(top), tuple(second), tuple(entropy), len(tokens), ended)

    def _read(self, row: np.ndarray, ids: list[list[int]], prompt_tokens: int, reused: int) -> LetteredScores:
        logp = row.astype(np.float64) - _logsumexp(row.astype(np.float64))
        mass = np.array([_logsumexp(logp[i]) for i in ids])
        total = _logsumexp(mass)
        return LetteredScores(
            tuple(float(v) for v in mass - total), (1,) * len(ids), prompt_tokens, reused, label_mass=math.exp(total)
        )

    def _step(self, tok: int) -> np.ndarray:
        """Append ``tok`` to sequence 0 and decode it; the next token's logits."""
        self._batch.reset()
        j = self._add(tok, len(self._cached), 0, True)
        self._ctx.decode(self._batch)
        self._cached.append(tok)
        return self._row(j)

    def _greedy(self, tokens: list[int], limit: int) -> tuple[bytes, int]:
        """Greedy decoding after ``tokens`` (prefilled into sequence 0) until an end-of-generation
        token, the answer cue, or ``limit`` tokens; the text written and its token count."""
        row, _ = self._prefill(tokens)
        vocab = self._model.vocab
        text, n = b"", 0
        for _ in range(limit):
            if self.cancelled():
                break
            tok = int(np.argmax(row))
            if self._lib.llama_vocab_is_eog(vocab, tok):
                break
            text += self._model.detokenize([tok])
            n += 1
            if text.rstrip().endswith(CUE_BYTES):
                break
            row = self._step(tok)
        return text, n
