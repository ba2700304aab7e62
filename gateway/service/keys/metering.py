"""What a stream uses, counted as it is relayed: every stream is charged, and a limited key's
stream stops at its limit.

Every streamed chat or text completion asks its upstream for usage (``stream_options.include_usage``,
set by :func:`gateway.service.dispatch.dispatch`); the usage chunk reaches the client only when
the client asked for it (:meth:`StreamMeter.passes`). An engine that reports none (llama.cpp's
server, some providers) is charged what triage relayed: the prompt estimated from its UTF-8
bytes (:func:`policies.fit.estimate`, more tokens than English text has), the completion as the
larger of the chunks that carried text and its bytes at the same rate.

For a key with a ``tpm`` or a budget (or a key of a team, whose limits it shares), the stream is
counted as it goes: every :data:`CHECK_EVERY` generated chunks, those tokens and their cost are
written to the key's tpm window and spend, and the key's limits are checked again (no request counted
against ``rpm``). A stream that has crossed one is stopped with that limit's error, in-band. At the end, what the
engine reported (or the estimate) less what was written on the way is recorded, as for any
request. A stream overshoots its key's limit by at most its prompt and :data:`CHECK_EVERY`
tokens (and what concurrent requests of the key use meanwhile, as everywhere).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.service.keys import quotas
from gateway.service.runtime import Runtime
from policies import spend
from policies.fit import BYTES_PER_TOKEN, estimate, shape_of
from policies.schema import ApiKey

CHECK_EVERY = 32  # generated chunks between two checks of a limited key's tpm and budget

Usage = dict[str, int]


def asked_usage(body: Mapping[str, Any]) -> bool:
    """Whether a client's chat or completion body asked for the usage chunk."""
    options = body.get("stream_options")
    return isinstance(options, Mapping) and options.get("include_usage") is True


def _generated(chunk: Mapping[str, Any]) -> int:
    """UTF-8 bytes of what a chat or completion chunk carries that the model generated."""
    n = 0
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        if isinstance(text := choice.get("text"), str):
            n += len(text.encode())
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            continue
        for name in ("content", "reasoning_content", "reasoning", "refusal"):
            if isinstance(value := delta.get(name), str):
                n += len(value.encode())
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping):
                n += sum(len(v.encode()) for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str))
    return n


@dataclass
class StreamMeter:
    """One stream's count: fed every chunk the upstream sent, in order."""

    rt: Runtime
    key: ApiKey | None
    model: str
    kind: str
    prompt: Any  # the request's messages (chat) or prompt (completion): the estimate's input
    asked: bool  # the client asked for the usage chunk
    reported: Usage | None = None  # the engine's usage, when it sent one
    chunks: int = 0  # chunks that carried generated text
    generated_bytes: int = 0
    written_tokens: int = 0  # counted on the store while the stream ran
    written_cost: float = 0.0
    _unchecked: int = field(default=0, repr=False)

    @property
    def limited(self) -> bool:
        """The key (or its team, whose limits it shares) may have a tpm or a budget to stop at."""
        if self.key is None:
            return False
        lim = self.key.limits
        return self.key.team is not None or (
            lim.tpm is not None or lim.budget_per_day is not None or lim.budget_per_month is not None
        )

    def feed(self, chunk: Mapping[str, Any]) -> bool:
        """Count ``chunk``; whether it goes on to the client (a usage-only chunk the client did not
        ask for does not)."""
        usage = chunk.get("usage")
        if isinstance(usage, Mapping) and usage:
            self.reported = {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}
        if n := _generated(chunk):
            self.chunks += 1
            self.generated_bytes += n
            self._unchecked += 1
        return self.asked or bool(chunk.get("choices")) or not isinstance(usage, Mapping)

    def strip(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The chunk as the client gets it: no ``usage`` field it did not ask for."""
        if not self.asked and "usage" in chunk:
            chunk.pop("usage")
        return chunk

    @property
    def estimated(self) -> bool:
        return self.reported is None

    def usage(self) -> Usage:
        """What the stream used: the engine's figures, else the estimate."""
        if self.reported is not None:
            return dict(self.reported)
        body = {"messages" if self.kind == "chat" else "prompt": self.prompt}
        prompt = estimate(shape_of(self.kind, body)) if self.prompt is not None else 0
        completion = max(self.chunks, math.ceil(self.generated_bytes / BYTES_PER_TOKEN))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def checkpoint(self) -> None:
        """For a limited key, every :data:`CHECK_EVERY` generated chunks: write them, then check
        the key's limits again (raises the limit's error: the stream stops)."""
        if not self.limited or self._unchecked < CHECK_EVERY:
            return
        assert self.key is not None
        tokens, self._unchecked = self._unchecked, 0
        owed = {"completion_tokens": tokens, "total_tokens": tokens}
        cost = quotas.price(self.rt, self.model, owed) - quotas.price(
            self.rt, self.model, None
        )  # no per-call price yet
        await quotas.record(self.rt, self.key, self.model, owed, cost)
        self.written_tokens += tokens
        self.written_cost += cost
        await quotas.recheck(self.rt, self.key)

    def rest(self, usage: Mapping[str, Any] | None, cost: float) -> tuple[Usage | None, float]:
        """What is left to record at the end: ``usage`` and ``cost`` less what was written on the way."""
        if not self.written_tokens and not self.written_cost:
            return (dict(usage) if usage is not None else None), cost
        tokens = max(spend.tokens(usage) - self.written_tokens, 0)
        return {"total_tokens": tokens}, max(cost - self.written_cost, 0.0)
