"""The lean upstream client (backends/http1.py) against real sockets: an asyncio server on a free
loopback port that answers as each test scripts it, byte for byte (engines' own answers are tested
through the openai backend in tests/backends/test_failover.py, test_vllm.py and the rest)."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import uvloop

from backends.http1 import Broken, Pool, Target

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
Run = Callable[[Awaitable[None]], None]


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Run:
    """Runs a test's coroutine on the standard loop, then on uvloop (the one ``triage serve`` runs)."""

    def run(main: Awaitable[None]) -> None:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
            runner.run(main)  # type: ignore[arg-type]

    return run


OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request: its head, then as many body bytes as its Content-Length says."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + (await reader.readexactly(length) if length else b"")


class Server:
    """A loopback server whose every connection runs ``handler``; it counts connections."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> Server:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self._server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    def url(self, path: str = "/v1/chat/completions", scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def keep_alive(self, answer: bytes) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                self.requests.append(await read_request(reader))
                writer.write(answer)
                await writer.drain()

        return handler


def keep_alive(answer: bytes) -> Server:
    server = Server(lambda r, w: asyncio.sleep(0))
    server.handler = server.keep_alive(answer)
    return server


async def post(pool: Pool, url: str, body: bytes = b'{"a":1}') -> tuple[int, bytes]:
    resp = await pool.request("POST", url, {"Content-Type": "application/json"}, body)
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


def test_a_target_is_split_once_with_its_default_port() -> None:
    assert Target.of("https://api.example.com/v1/chat").origin.port == 443
    assert Target.of("https://api.example.com/v1/chat").origin.authority == "api.example.com"
    t = Target.of("http://10.0.0.1:8000/v1/models?x=1")
    assert (t.origin.host, t.origin.port, t.origin.authority, t.path) == (
        "10.0.0.1",
        8000,
        "10.0.0.1:8000",
        "/v1/models?x=1",
    )
    with pytest.raises(ValueError):
        Target.of("ftp://host/x")


def test_requests_reuse_one_kept_alive_connection_and_send_what_was_asked(run: Run) -> None:
    async def main() -> None:
        async with keep_alive(OK) as server:
            pool = Pool(connect_s=2)
            for _ in range(3):
                assert await post(pool, server.url()) == (200, b'{"ok":true}')
            await pool.close()
            assert server.connections == 1
            first = server.requests[0]
            assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            assert f"Host: 127.0.0.1:{server.port}\r\n".encode() in first
            assert b"Content-Length: 7\r\n" in first and first.endswith(b'\r\n\r\n{"a":1}')

    run(main())


def test_a_chunked_stream_arrives_piece_by_piece(run: Run) -> None:
    async def main() -> None:
        second = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\ndata:1\r\n")
            await writer.drain()
            await second.wait()
            writer.write(b"6\r\ndata:2\r\n0\r\n\r\n")
            await writer.drain()
            await read_request(reader)  # the connection stays open for the next request

        async with Server(handler) as server:
            pool = Pool(connect_s=2)
            resp = await pool.request("POST", server.url(), {}, b"{}")
            chunks = resp.iter_chunks()
            assert await anext(chunks) == b"data:1"  # before the server sends the rest
            second.set()
            assert [c async for c in chunks] == [b"data:2"]
            resp.release()
            assert len(pool._idle[Target.of(server.url()).origin]) == 1  # read to its end: kept
            await pool.close()

    run(main())


def test_a_connection_the_server_closed_while_idle_is_replaced_unseen(run: Run) -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(OK)
            await writer.drain()
            # then it closes the kept-alive connection (an engine's idle timeout)

        async with Server(handler) as server:
            pool = Pool(connect_s=2)
            assert await post(pool, server.url()) == (200, b'{"ok":true}')
            await asyncio.sleep(0.05)
            assert await post(pool, server.url()) == (200, b'{"ok":true}')
            assert server.connections == 2
            await pool.close()

    run(main())


def test_when_every_idle_connection_is_dead_the_retry_opens_a_new_one(run: Run) -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(OK)
            await writer.drain()
            await read_request(reader)  # a restarted engine: the next request is read, never answered

        async with Server(handler) as server:
            pool = Pool(connect_s=2)
            answers = await asyncio.gather(*(post(pool, server.url()) for _ in range(3)))
            assert answers == [(200, b'{"ok":true}')] * 3 and server.connections == 3
            assert await post(pool, server.url()) == (200, b'{"ok":true}')
            assert server.connections == 4  # one dead idle connection tried, then a new one
            await pool.close()

    run(main())


def test_a_refused_connection_is_broken(run: Run) -> None:
    async def main() -> None:
        async with keep_alive(OK) as server:
            url = server.url()
        pool = Pool(connect_s=2)
        with pytest.raises(Broken, match="cannot connect"):
            await post(pool, url)

    run(main())


@pytest.mark.parametrize(
    "answer",
    [
        b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"cut',  # the body ends early
        b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"cut\r\n',  # the chunks end early
    ],
)
def test_an_answer_cut_short_is_broken_and_its_connection_dropped(answer: bytes, run: Run) -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()

        async with Server(handler) as server:
            pool = Pool(connect_s=2)
            resp = await pool.request("POST", server.url(), {}, b"{}")
            with pytest.raises(Broken, match="before its answer ended"):
                await resp.read()
            resp.release()
            assert not pool._idle.get(Target.of(server.url()).origin)
            await pool.close()

    run(main())


def test_an_answer_that_is_not_http_is_broken(run: Run) -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(1)

        async with Server(handler) as server:
            with pytest.raises(Broken, match=r"not HTTP/1\.1"):
                await post(Pool(connect_s=2), server.url())

    run(main())


def test_a_request_given_up_while_waiting_closes_its_connection(run: Run) -> None:
    async def main() -> None:
        gone = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            await reader.read()  # never answers; returns when the client hangs up
            gone.set()

        async with Server(handler) as server:
            pool = Pool(connect_s=2)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await post(pool, server.url())
            async with asyncio.timeout(2):
                await gone.wait()
            await pool.close()

    run(main())


def test_a_body_without_a_length_ends_with_the_connection(run: Run) -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * 5000)
            await writer.drain()

        async with Server(handler) as server:
            pool = Pool(connect_s=2)
            assert await post(pool, server.url()) == (200, b"x" * 5000)
            assert await post(pool, server.url()) == (200, b"x" * 5000)
            assert server.connections == 2  # Connection: close is not kept
            await pool.close()

    run(main())


def test_an_interim_answer_is_skipped_and_an_error_answer_read(run: Run) -> None:
    async def main() -> None:
        answer = (
            b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nX-Thing: A\r\n\r\nbusy"
        )
        async with keep_alive(answer) as server:
            pool = Pool(connect_s=2)
            resp = await pool.request("GET", server.url("/health"), {})
            assert (resp.status, resp.headers["x-thing"], await resp.read()) == (503, "A", b"busy")
            resp.release()
            assert b"Content-Length" not in server.requests[0]  # a GET carries no body
            await pool.close()

    run(main())


def test_an_answer_released_half_read_and_an_old_idle_connection_are_not_reused(run: Run) -> None:
    async def main() -> None:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await read_request(reader)
                writer.write(OK[:-4])
                await writer.drain()
                await asyncio.sleep(0.02)
                writer.write(OK[-4:])
                await writer.drain()

        async with Server(handler) as server:
            pool = Pool(connect_s=2, idle_s=0.2)
            resp = await pool.request("POST", server.url(), {}, b"{}")
            resp.release()  # its body still arriving: the connection closes
            assert await post(pool, server.url()) == (200, b'{"ok":true}')
            assert await post(pool, server.url()) == (200, b'{"ok":true}')  # read whole: kept
            assert server.connections == 2
            await asyncio.sleep(0.3)  # older than idle_s: closed rather than reused
            assert await post(pool, server.url()) == (200, b'{"ok":true}')
            assert server.connections == 3
            await pool.close()

    run(main())


def test_a_large_body_read_slowly_pauses_the_socket_and_arrives_whole(run: Run) -> None:
    async def main() -> None:
        body = bytes(range(256)) * (4 * 4096)  # 4 MiB, past the high-water mark

        async with keep_alive(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body) as server:
            pool = Pool(connect_s=2)
            resp = await pool.request("POST", server.url(), {}, b"{}")
            await asyncio.sleep(0.2)  # the server writes; the client reads nothing yet
            assert resp._conn._buffered <= 2 * (1 << 20) + 65536  # reading paused near the mark
            assert await resp.read() == body
            resp.release()
            assert await post(pool, server.url()) == (200, body)
            assert server.connections == 1
            await pool.close()

    run(main())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl's CLI makes the test's certificate")
def test_tls_is_verified_against_the_trusted_authorities(tmp_path: Path, run: Run) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)

    async def main() -> None:
        server = keep_alive(OK)
        server.tls = server_tls
        async with server:
            with pytest.raises(Broken, match="cannot connect"):  # self-signed: not trusted by default
                await post(Pool(connect_s=2), server.url(scheme="https"))
            trusting = Pool(connect_s=2, tls=ssl.create_default_context(cafile=str(cert)))
            assert await post(trusting, server.url(scheme="https")) == (200, b'{"ok":true}')
            await trusting.close()

    run(main())


def test_a_header_value_with_a_line_break_is_refused_before_sending(run: Run) -> None:
    async def main() -> None:
        async with keep_alive(OK) as server:
            pool = Pool(connect_s=2)
            with pytest.raises(Broken, match="line break"):
                await pool.request("POST", server.url(), {"Authorization": "Bearer x\r\nX-Evil: 1"}, b"{}")
            assert server.requests == []
            await pool.close()

    run(main())
