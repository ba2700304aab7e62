"""The generating surfaces as adapters around one handler: chat and text completions (as they
are), the Responses API and Anthropic's Messages (translated to chat on the way in, back on the
way out). Each says what chat body a request is, how a whole chat answer reads in its own shape
(as JSON, or as its event sequence when the request streamed), and how a chat stream is relayed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

import orjson
import structlog

from backends.base import Body, Kind
from gateway.http import anthropic_messages, responses
from gateway.http.app_state import GatewayState
from gateway.http.doors import Call
from gateway.http.exchange import Exchange
from gateway.http.relay import as_chunk, chat_chunks, translated
from gateway.service import typed
from gateway.service.bodies import check
from gateway.service.dispatch import Served
from gateway.service.keys import metering
from gateway.service.runtime import Runtime
from gateway.state.responses import Responses as Responses_
from gateway.state.stores import StoreDown
from policies.errors import InvalidRequest

log = structlog.get_logger("triage.http")


class Surface(Protocol):
    kind: Kind
    chat: Body  # the request as a chat (or text completion) body

    async def whole(self, completion: Body) -> Body: ...
    async def whole_events(self, completion: Body) -> bytes: ...
    def relay(self, ex: Exchange, served: Served) -> AsyncGenerator[bytes, None]: ...


class OpenAI:
    """Chat and text completions: the body as sent, the answer as the engine gave it."""

    def __init__(self, kind: Kind, call: Call) -> None:
        self.kind, self.chat = kind, call.body

    async def whole(self, completion: Body) -> Body:
        return completion

    async def whole_events(self, completion: Body) -> bytes:
        chunks = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in typed.chunks(completion))
        return chunks + b"data: [DONE]\n\n"

    def relay(self, ex: Exchange, served: Served) -> AsyncGenerator[bytes, None]:
        return chat_chunks(ex, served, self.kind, metering.asked_usage(self.chat))


class Responses:
    """``POST /v1/responses``: input items to chat messages (after the stored turns of
    ``previous_response_id``, the key's own), the answer to a ``response``, stored unless
    ``store: false``: in the fleet's store where the policy's ``state`` is shared (Redis), else in
    this process's. Made by :meth:`open` (the stored turns are read first)."""

    kind: Kind = "chat"

    def __init__(self, req: Body, store: Responses_, owner: str | None) -> None:
        self.req, self.store, self.owner = req, store, owner
        self.id = responses.new_id("resp")
        self.kept = req.get("store", True) is not False
        self.chat: Body = {}
        self.turns: list[Body] = []
        self._pending: tuple[Body, Body] | None = None  # a streamed answer to store before its last event

    @classmethod
    async def open(cls, state: GatewayState, call: Call) -> Responses:
        req = call.body
        check(responses.ResponsesRequest, req)
        rt = call.ex.rt
        who, operator = owner(rt, call.request.headers.get("authorization"))
        self = cls(req, rt.responses or state.responses, who)
        earlier: list[Body] = []
        previous = req.get("previous_response_id")
        if previous:
            before = await self.store.get(previous, self.owner, operator)
            limit = rt.policy.limits.max_body_bytes
            if before.size + len(call.raw) > limit:  # the conversation is sent upstream whole: it counts as the body
                raise InvalidRequest(
                    f"the conversation up to this turn is {before.size + len(call.raw)} bytes, over the "
                    f"{limit}-byte body limit: start a new one",
                    param="previous_response_id",
                )
            earlier = before.messages
        self.chat, self.turns = responses.chat_body(req, earlier)
        return self

    async def whole(self, completion: Body) -> Body:
        out, turn = responses.from_chat(self.req, self.id, completion)
        if self.kept:
            await self._put(out, turn)
        return out

    async def whole_events(self, completion: Body) -> bytes:
        out = await self.whole(completion)
        t = responses.StreamTranslator(self.req, self.id, out["model"])
        return t.start() + t.feed(as_chunk(completion)) + t.finish()[0]

    def relay(self, ex: Exchange, served: Served) -> AsyncGenerator[bytes, None]:
        keep = self._keep if self.kept else None
        inner = translated(ex, served, responses.StreamTranslator(self.req, self.id, served.model, keep))
        return self._stored_first(inner)

    async def _stored_first(self, inner: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """The stream, with the answer stored before its last event goes out: a client that
        continues it at once finds it, on any gateway."""
        try:
            async for data in inner:
                if self._pending is not None:
                    out, turn = self._pending
                    self._pending = None
                    await self._put(out, turn)
                yield data
        finally:
            await inner.aclose()

    def _keep(self, out: Body, turn: Body) -> None:
        self._pending = (out, turn)

    async def _put(self, out: Body, turn: Body) -> None:
        try:
            await self.store.put(out, [*self.turns, turn], self.owner)
        except StoreDown as exc:  # the answer still goes out; a later previous_response_id is a 404
            log.error("response_not_stored", response_id=self.id, error=exc.message)


class Messages:
    """``POST /v1/messages`` (Anthropic): the request to chat, the answer to a ``message``."""

    kind: Kind = "chat"

    def __init__(self, call: Call) -> None:
        self.chat = anthropic_messages.chat_body(call.body)

    async def whole(self, completion: Body) -> Body:
        return anthropic_messages.from_chat(completion)

    async def whole_events(self, completion: Body) -> bytes:
        t = anthropic_messages.StreamTranslator(str(completion.get("model", "")))
        return t.start() + t.feed(as_chunk(completion)) + t.finish()

    def relay(self, ex: Exchange, served: Served) -> AsyncGenerator[bytes, None]:
        return translated(ex, served, anthropic_messages.StreamTranslator(served.model))


def owner(rt: Runtime, authorization: str | None) -> tuple[str | None, bool]:
    """Who a stored object belongs to (the key's sha256; None without keys), and whether that key
    is an operator's (it sees every key's)."""
    if not rt.keys_required:
        return None, False
    digest = rt.key_digest(authorization)
    return digest, digest in rt.operator_hashes
