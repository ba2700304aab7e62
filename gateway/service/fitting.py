"""Whether a model can take a request, in the request path: what the model takes (the runtime's
:class:`policies.fit.Fit`), and the prompt counted by the model's own tokenizer only where it may
not fit (most prompts surely fit and are never tokenized: ``policies.fit``)."""

from __future__ import annotations

import asyncio

import structlog

from backends import tokens
from backends.tokens import Tokenizer
from gateway.service.runtime import Runtime
from policies.errors import PolicyInvalid
from policies.fit import BYTES_PER_TOKEN, PER_MESSAGE, Shape, estimate, surely_fits, takes, too_long

log = structlog.get_logger("triage.fitting")


async def refusal(rt: Runtime, model: str, shape: Shape) -> str | None:
    """Why ``model`` cannot take a request of this shape; None when it can (or nothing is known)."""
    fit = rt.fits.get(model)
    if fit is None:
        return None
    if (why := takes(fit, shape)) is not None:
        return why
    if surely_fits(fit, shape):
        return None
    count, how = await prompt_tokens(rt, model, shape)
    return too_long(fit, shape, count, how)


async def prompt_tokens(rt: Runtime, model: str, shape: Shape) -> tuple[int, str]:
    """The prompt's tokens for ``model``, and how they were counted."""
    tok = await _tokenizer(rt, model)
    if tok is None:
        return estimate(shape), f"estimated: UTF-8 bytes / {BYTES_PER_TOKEN}, no tokenizer known"
    counted = len(await asyncio.to_thread(tok.tokenize, shape.text))
    return counted + PER_MESSAGE * shape.messages, f"counted by {tok.name}"


async def _tokenizer(rt: Runtime, model: str) -> Tokenizer | None:
    """The model's tokenizer (its GGUF file's vocabulary, or its ``tokenizer.json``), loaded once
    per runtime in a worker thread; None when none is known or it cannot be read (then estimated)."""
    known = rt.tokenizers
    if model in known:
        return known[model]
    try:
        tok = await asyncio.to_thread(tokens.tokenizer_for, rt.policy, model, rt.base_dir)
    except PolicyInvalid as exc:
        log.warning("tokenizer_unreadable", model=model, problem=exc.problems[0])
        tok = None
    known[model] = tok
    return tok
