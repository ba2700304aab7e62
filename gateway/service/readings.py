"""What the encoder reads of a request, without the encoder: the text it reads (the last user turn),
and a request's readings kept for a second reader of the same text (a guardrail, then the router).
Light on purpose: the guardrails layer imports it at assembly, and ``import gateway`` must not load
ONNX Runtime (``gateway.service.encoding`` does)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from backends.base import Body, Kind
from gateway.service.messages import text as message_text

# a request's readings (the encoder's ``Reading`` by text), kept while it is served for a second
# reader of the same text: set by `readings_kept`, None outside it (every read is a forward)
KEPT: ContextVar[dict[str, Any] | None] = ContextVar("triage_readings", default=None)


@contextmanager
def readings_kept() -> Iterator[None]:
    """Within it, ``Encoding.read`` of a text this request already read is that reading."""
    token = KEPT.set({})
    try:
        yield
    finally:
        KEPT.reset(token)


def last_turn(kind: Kind, body: Mapping[str, Any]) -> str:
    """The text the router reads: the last user turn (a text completion's prompt)."""
    return turns(kind, dict(body))[0]


def turns(kind: Kind, body: Body) -> tuple[str, list[str]]:
    """The last user turn, and the earlier user turns (oldest first)."""
    if kind == "completion":
        prompt = body.get("prompt")
        return (prompt if isinstance(prompt, str) else " ".join(p for p in prompt or () if isinstance(p, str))), []
    users = [message_text(m.get("content")) for m in body.get("messages") or () if m.get("role") == "user"]
    if not users:
        return "", []
    return users[-1], users[:-1]
