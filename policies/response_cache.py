"""The response cache's pure rules: whether a request may be answered from the cache, what its
answer is a function of (the key), and a whole answer turned to stream chunks and back.

A request is looked up only where its answer is reproducible (temperature 0 or a seed), or the
policy (``when: always``) or the request (``x-triage-cache: allow``) accepts a kept answer; one
whose content the key cannot hold (an image by URL, a file reference: their bytes are not in the
body) is passed through and said so. The key is the policy's version, the requested model, the
scope (the key's sha256, or shared) and every field of the body that decides the answer; fields
that only say how to deliver it (``stream``, ``stream_options``, ``user``, ``metadata``) are left
out, so a streamed and a whole request share their answer, on any surface (the Responses API and
Messages are chat bodies by the time they are keyed); numbers are keyed by value (``temperature: 0``
and ``0.0`` are one entry).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from policies.schema import ResponseCacheSpec

FORMAT = 1  # bump when what a kept entry holds changes: older entries are then never read
DELIVERY = frozenset({"stream", "stream_options", "user", "metadata", "store", "service_tier", "safety_identifier"})
Directive = Literal["use", "allow", "refresh", "bypass"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether to read the cache, whether to keep the answer, and why not."""

    read: bool
    write: bool
    why: str | None = None  # a bypass's reason (said in ``x-triage-cache-bypass``)


def directive(header: str | None) -> Directive | None:
    """The request's ``x-triage-cache`` header: allow (accept a kept answer for a sampled request),
    refresh (do not read, keep the new answer), bypass (neither); None when absent or unknown."""
    value = (header or "").strip().lower()
    return value if value in ("allow", "refresh", "bypass") else None  # type: ignore[return-value]


def verdict(spec: ResponseCacheSpec, kind: str, body: Mapping[str, Any], said: Directive | None) -> Verdict:
    """What the cache does for this request."""
    if said == "bypass":
        return Verdict(False, False, "the request said bypass")
    if (why := unkeyable(kind, body)) is not None:
        return Verdict(False, False, why)
    if spec.when != "always" and said != "allow" and not reproducible(body):
        return Verdict(False, False, "sampled: no temperature 0 or seed")
    return Verdict(said != "refresh", True)


def reproducible(body: Mapping[str, Any]) -> bool:
    """Temperature 0, or a seed: the engine gives the same answer again (the cache's premise)."""
    return body.get("temperature") == 0 or body.get("seed") is not None


def unkeyable(kind: str, body: Mapping[str, Any]) -> str | None:
    """Why the body does not hold all its request says (an image by URL, a file by reference)."""
    if kind != "chat":
        return None
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, Mapping) else None
        for part in content if isinstance(content, list) else []:
            kind_of = part.get("type") if isinstance(part, Mapping) else None
            if kind_of == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, Mapping) else url
                if not (isinstance(url, str) and url.startswith("data:")):
                    return "an image by URL"
            elif kind_of in ("file", "input_file"):
                return "a file reference"
    return None


def normal(value: Any) -> Any:
    """``value`` with every number that equals an integer written as that integer (``0.0`` is ``0``,
    ``1.0`` is ``1``), in every object and list: equal requests are one entry, however a client
    writes its numbers. Text is left as it is."""
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    if isinstance(value, dict):
        return {k: normal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normal(v) for v in value]
    return value


def key(version: str, scope: str, kind: str, body: Mapping[str, Any]) -> str:
    """The exact cache's key: the policy's version, the scope (a key's sha256, or shared), the kind
    and every field that decides the answer (the requested model included), its numbers normal."""
    fields = {k: normal(v) for k, v in body.items() if k not in DELIVERY}
    parts = [FORMAT, version, scope, kind, fields]
    return "answer:" + hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).hexdigest()


def context_key(version: str, scope: str, kind: str, body: Mapping[str, Any]) -> str:
    """The semantic cache's bucket: everything of the exact key but the last user turn's text, so
    a similar question is answered only in the same context (system prompt, earlier turns, fields)."""
    messages = list(body.get("messages") or [])
    last = max((i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") == "user"), default=-1)
    fields = {k: normal(v) for k, v in body.items() if k not in DELIVERY and k != "messages"}
    before = normal(messages[:last] if last >= 0 else messages)
    after = normal(messages[last + 1 :] if last >= 0 else [])
    parts = [FORMAT, version, scope, kind, fields, before, after]
    return "ctx:" + hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).hexdigest()


def last_user_text(body: Mapping[str, Any]) -> str | None:
    """The last user turn's text (its text parts joined); None without one, or with other parts."""
    for message in reversed(list(body.get("messages") or [])):
        if not isinstance(message, Mapping) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
            return "\n".join(str(p.get("text", "")) for p in content)
        return None
    return None


def assemble(kind: str, chunks: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """A stream's chunks as the whole answer the same request would have got unstreamed; None when
    the stream did not finish (a choice without its finish reason) or held nothing."""
    base: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    usage: Any = None
    for chunk in chunks:
        if not base:
            base = {k: chunk.get(k) for k in ("id", "created", "model", "system_fingerprint") if chunk.get(k)}
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices") or []:
            i = c.get("index", 0)
            into = choices.setdefault(i, {"index": i, "finish_reason": None})
            if kind == "chat":
                _add_delta(into.setdefault("message", {"role": "assistant", "content": None}), c.get("delta") or {})
            else:
                into["text"] = into.get("text", "") + (c.get("text") or "")
            if c.get("finish_reason"):
                into["finish_reason"] = c["finish_reason"]
    if not choices or any(c["finish_reason"] is None for c in choices.values()):
        return None
    obj = "chat.completion" if kind == "chat" else "text_completion"
    whole = {**base, "object": obj, "choices": [choices[i] for i in sorted(choices)]}
    if usage:
        whole["usage"] = usage
    return whole


def _add_delta(message: dict[str, Any], delta: Mapping[str, Any]) -> None:
    for field in ("content", "reasoning_content", "refusal"):
        if isinstance(text := delta.get(field), str):
            message[field] = (message.get(field) or "") + text
    for call in delta.get("tool_calls") or []:
        calls: list[dict[str, Any]] = message.setdefault("tool_calls", [])
        i = call.get("index", len(calls))
        while len(calls) <= i:
            calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        into = calls[i]
        if call.get("id"):
            into["id"] = call["id"]
        fn = call.get("function") or {}
        into["function"]["name"] += fn.get("name") or ""
        into["function"]["arguments"] += fn.get("arguments") or ""


def replay(kind: str, whole: Mapping[str, Any], usage: bool) -> list[dict[str, Any]]:
    """A whole answer as the chunks of a stream: per choice its text (and tool calls), then its
    finish; the usage last when the request asked for it (``stream_options.include_usage``)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    base = {k: whole.get(k) for k in ("id", "created", "model") if k in whole} | {"object": obj}
    out: list[dict[str, Any]] = []
    for c in whole.get("choices") or []:
        i = c.get("index", 0)
        if kind == "chat":
            message = c.get("message") or {}
            delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
            for field in ("reasoning_content", "refusal"):
                if message.get(field):
                    delta[field] = message[field]
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
            out.append({**base, "choices": [{"index": i, "delta": delta, "finish_reason": None}]})
            out.append({**base, "choices": [{"index": i, "delta": {}, "finish_reason": c.get("finish_reason")}]})
        else:
            text = {"index": i, "text": c.get("text") or "", "finish_reason": c.get("finish_reason")}
            out.append({**base, "choices": [text]})
    if usage and whole.get("usage"):
        out.append({**base, "choices": [], "usage": whole["usage"]})
    return out
