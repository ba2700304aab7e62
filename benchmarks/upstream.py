"""A tiny, fast OpenAI-compatible upstream for benchmarks: raw asyncio protocol + httptools.

``POST /v1/chat/completions`` answers a fixed small ``chat.completion`` (with usage), or the
same reply as SSE when the body asks for ``stream: true``; ``GET /v1/models`` lists one model.
Responses are prebuilt bytes, so the upstream is never the bottleneck of a gateway benchmark.

Run it as its own process: ``python -m benchmarks.upstream --port 9000``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import cast

import httptools
import orjson

MODEL = "bench"
_REPLY = "Hello from the bench upstream."


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    head = (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    return head + body


def _completion() -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1700000000,
            "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": _REPLY}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
        }
    )


def _sse() -> bytes:
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": MODEL}
    chunks = [
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        *(
            {**base, "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
            for w in _REPLY.split(" ")
        ),
        {
            **base,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
        },
    ]
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


CHAT = _response(b"200 OK", b"application/json", _completion())
STREAM = _response(b"200 OK", b"text/event-stream", _sse())
MODELS = _response(
    b"200 OK",
    b"application/json",
    orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]}),
)
TRACES = _response(b"200 OK", b"application/x-protobuf", b"")
NOT_FOUND = _response(
    b"404 Not Found",
    b"application/json",
    orjson.dumps({"error": {"message": "not found", "type": "invalid_request_error"}}),
)
BAD = _response(
    b"400 Bad Request",
    b"application/json",
    orjson.dumps({"error": {"message": "body is not JSON", "type": "invalid_request_error"}}),
)


def _answer(method: bytes, path: bytes, body: bytes) -> bytes:
    if method == b"POST" and path in (b"/v1/chat/completions", b"/chat/completions"):
        try:
            req = orjson.loads(body)
        except orjson.JSONDecodeError:
            return BAD
        return STREAM if isinstance(req, dict) and req.get("stream") else CHAT
    if method == b"GET" and path in (b"/v1/models", b"/models", b"/health"):
        return MODELS
    if method == b"POST" and path == b"/v1/traces":  # an OTLP/HTTP sink, for the traced rows
        return TRACES
    return NOT_FOUND


class _Conn(asyncio.Protocol):
    """One keep-alive connection; pipelined requests are answered in order."""

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._body.clear()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._transport is not None
        path = self._url.split(b"?", 1)[0]
        self._transport.write(_answer(self._parser.get_method(), path, b"".join(self._body)))
        if not self._parser.should_keep_alive():
            self._transport.close()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await loop.create_server(_Conn, host, port, backlog=2048, reuse_address=True)
    async with server:
        await stop.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    import uvloop

    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
