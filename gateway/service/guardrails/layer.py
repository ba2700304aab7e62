"""The guardrails as a layer around the generate path (composed once at assembly, outside the
response cache): the request's input guardrails run before it is routed (PII masked or refused,
then the jailbreak head on the last user turn, which the router then reads again from the
encoder's recent readings, then the hooks); its output guardrails run on the answer, whole or as a
stream's text arrives, and masked values come back in the answer where the policy says so.

A hit that refuses is a :class:`~policies.errors.GuardrailRefused` (a 400 in the surface's shape,
naming the guardrail); on a stream already under way, the same error cut in-band.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from backends.base import Body, ChunkStream
from gateway.service.context import Context
from gateway.service.guardrails.checks import Guardrails
from gateway.service.job import Job, Outcome, Serve
from gateway.service.messages import text as message_text
from gateway.service.readings import last_turn, readings_kept
from gateway.service.runtime import Runtime
from policies.guardrails import Span, StreamRestorer, Vault, Verdict, mask, redact, refusal, restore
from policies.schema_guardrails import PiiGuardrail


def guarded(inner: Serve, guards: Guardrails) -> Serve:
    """``inner`` with the policy's guardrails around it."""

    async def serve(rt: Runtime, job: Job, ctx: Context) -> Outcome:
        names = guards.names(ctx)
        if not names:
            return await inner(rt, job, ctx)
        vault = Vault()
        with readings_kept():  # the jailbreak guardrail's reading, the router's too
            body = await screen_input(rt, guards, names, job, ctx, vault)
            if body is not None:
                job = replace(job, body=MappingProxyType(body))
            out = await inner(rt, job, ctx)
        outputs = guards.staged(names, "output")
        served = out.served
        if served is None or not (outputs or vault.values):
            return out
        if served.completion is not None:
            await screen_answer(guards, outputs, served.completion.body, ctx, vault)
        elif served.stream is not None:
            served.stream = GuardedStream(served.stream, guards, outputs, ctx, vault, job.kind)
        return out

    return serve


async def screen_input(
    rt: Runtime, guards: Guardrails, names: Sequence[str], job: Job, ctx: Context, vault: Vault
) -> dict[str, Any] | None:
    """The input guardrails, in order: PII (masked in every message), then the others on the
    (masked) text; the body to send when something was masked (None: the job's own)."""
    inputs = guards.staged(names, "input")
    if not inputs:
        return None
    body: dict[str, Any] | None = None
    pii = [n for n in inputs if isinstance(guards.spec.checks[n], PiiGuardrail)]
    if pii:
        body = await _mask_body(guards, pii, dict(job.body), job.kind, ctx, vault)
    current: Mapping[str, Any] = body if body is not None else job.body
    others = [n for n in inputs if n not in pii]
    verdicts = []
    for name in others:
        g = guards.spec.checks[name]
        text = last_turn(job.kind, current) if g.type == "jailbreak" else _prompt_text(job.kind, current)
        verdicts.append(await guards.check(name, "input", text, ctx, rt.encoding))
    guards.record(verdicts, "input", ctx)
    if (refused := refusal(verdicts, "request")) is not None:
        raise refused
    return body


async def _mask_body(
    guards: Guardrails, names: Sequence[str], body: dict[str, Any], kind: str, ctx: Context, vault: Vault
) -> dict[str, Any] | None:
    """Every text of the request looked at by the PII guardrails: refused, or its values masked."""
    texts = _texts(kind, body)
    found: list[list[Span]] = [[] for _ in texts]
    verdicts: list[Verdict] = []
    for name in names:
        for i, text in enumerate(texts):
            v = await guards.check(name, "input", text, ctx)
            verdicts.append(v)
            if v.outcome == "mask":
                found[i].extend(v.spans)
    guards.record(_merged(verdicts), "input", ctx)
    if (refused := refusal(verdicts, "request")) is not None:
        raise refused
    if not any(found):
        return None
    restoring = any(getattr(guards.spec.checks[n], "restore", False) for n in names)
    masked = [mask(t, s, vault) if restoring else redact(t, s) for t, s in zip(texts, found, strict=True)]
    return _with_texts(kind, body, masked)


def _merged(verdicts: Sequence[Verdict]) -> list[Verdict]:
    """One verdict per guardrail for the log and the counts (a hit on any text is its hit)."""
    out: dict[str, Verdict] = {}
    for v in verdicts:
        if v.guardrail not in out or (v.outcome != "pass" and out[v.guardrail].outcome == "pass"):
            out[v.guardrail] = v
    return list(out.values())


def _texts(kind: str, body: Mapping[str, Any]) -> list[str]:
    """Every text a request carries, in order: the prompt(s), or each message's content (its text parts)."""
    if kind == "completion":
        prompt = body.get("prompt")
        return [prompt] if isinstance(prompt, str) else [p for p in prompt or () if isinstance(p, str)]
    out = []
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
    return out


def _with_texts(kind: str, body: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """``body`` with its texts (in :func:`_texts`' order) replaced; the caller's own is not changed."""
    it = iter(texts)
    if kind == "completion":
        prompt = body.get("prompt")
        body["prompt"] = (
            next(it) if isinstance(prompt, str) else [next(it) if isinstance(p, str) else p for p in prompt or ()]
        )
        return body
    messages = []
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            m = {**m, "content": next(it)}
        elif isinstance(content, list):
            parts = [
                {**p, "text": next(it)} if isinstance(p, Mapping) and isinstance(p.get("text"), str) else p
                for p in content
            ]
            m = {**m, "content": parts}
        messages.append(m)
    body["messages"] = messages
    return body


def _prompt_text(kind: str, body: Mapping[str, Any]) -> str:
    """The whole prompt as one text (what a hook reads)."""
    if kind == "completion":
        return "\n".join(_texts(kind, body))
    return "\n".join(message_text(m.get("content")) for m in body.get("messages") or () if isinstance(m, Mapping))


async def screen_answer(guards: Guardrails, names: Sequence[str], whole: Body, ctx: Context, vault: Vault) -> None:
    """A whole answer's output guardrails (refused, or its values redacted), then the masked
    values restored; in place."""
    for choice in whole.get("choices") or ():
        message = choice.get("message")
        field, holder = ("content", message) if isinstance(message, dict) else ("text", choice)
        text = holder.get(field)
        if not isinstance(text, str) or not text:
            continue
        holder[field] = restore(await _checked(guards, names, text, ctx), vault)


async def _checked(guards: Guardrails, names: Sequence[str], text: str, ctx: Context) -> str:
    """The output guardrails on one text: raises on a refusal; PII they mask is redacted."""
    verdicts = [await guards.check(n, "output", text, ctx) for n in names]
    guards.record(verdicts, "output", ctx)
    if (refused := refusal(verdicts, "answer")) is not None:
        raise refused
    spans = [s for v in verdicts if v.outcome == "mask" for s in v.spans]
    return redact(text, spans) if spans else text


class GuardedStream(ChunkStream):
    """A stream's text checked as it arrives: each choice's text is held back ``hold_chars`` deep (a
    value cut between chunks is seen whole), checked each time that much more has come and at the
    end, refused (the error raised where the relay turns it into the surface's in-band error) or
    redacted, and the masked values restored."""

    def __init__(
        self, inner: ChunkStream, guards: Guardrails, names: Sequence[str], ctx: Context, vault: Vault, kind: str
    ) -> None:
        self.first, self.replica = inner.first, inner.replica
        self._inner, self._guards, self._names, self._ctx = inner, guards, list(names), ctx
        self._field = "text" if kind == "completion" else "content"
        self._hold = guards.spec.hold_chars if names else 0
        self._held: dict[int, str] = {}
        self._restorers: dict[int, StreamRestorer] = {}
        self._vault = vault

    async def __aiter__(self) -> AsyncIterator[Body]:
        last: Body | None = None
        async for chunk in self._inner:
            last = chunk
            for choice in chunk.get("choices") or ():
                holder = choice if self._field == "text" else choice.get("delta")
                if not isinstance(holder, dict):
                    continue
                i = int(choice.get("index") or 0)
                ending = choice.get("finish_reason") is not None
                delta = holder.get(self._field)
                text = await self._feed(i, delta if isinstance(delta, str) else "", ending)
                if text or isinstance(delta, str):
                    holder[self._field] = text
            yield chunk
        rest = {i: await self._feed(i, "", True) for i in list(self._held)}
        if any(rest.values()) and last is not None:  # no finish chunk carried it: one more chunk
            yield _tail(last, rest, self._field)

    async def _feed(self, i: int, delta: str, ending: bool) -> str:
        held = self._held.get(i, "") + delta
        restorer = self._restorers.setdefault(i, StreamRestorer(self._vault))
        if not ending and len(held) < 2 * self._hold:
            self._held[i] = held
            return restorer.feed("") if not self._hold else ""
        checked = await _checked(self._guards, self._names, held, self._ctx) if self._names else held
        cut = len(checked) if ending else max(0, len(checked) - self._hold)
        self._held[i] = checked[cut:]
        if ending:
            self._held.pop(i, None)
            return restorer.feed(checked[:cut]) + restorer.flush()
        return restorer.feed(checked[:cut])

    async def aclose(self) -> None:
        await self._inner.aclose()


def _tail(last: Body, rest: dict[int, str], field: str) -> Body:
    """A chunk that carries the text still held at the stream's end (shaped like the stream's)."""
    choices = []
    for i, text in sorted(rest.items()):
        if text:
            choices.append({"index": i, "text": text} if field == "text" else {"index": i, "delta": {"content": text}})
    return {k: v for k, v in last.items() if k not in ("choices", "usage")} | {"choices": choices}
