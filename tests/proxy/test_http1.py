"""proxy.http1 against a scripted raw server: keep-alive reuse, chunked bodies as they arrive,
closing early as the abort, the two failure kinds, idle expiry, header safety."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from proxy import http1

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """Serves each connection with ``handler``; counts connections and disconnects."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.connections = 0
        self.disconnects = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.disconnects.set()
            writer.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[RawServer]]]:
    servers: list[RawServer] = []

    async def start(handler: Handler) -> RawServer:
        s = RawServer(handler)
        s.server = await asyncio.start_server(s._serve, "127.0.0.1", 0)
        servers.append(s)
        return s

    yield start
    for s in servers:
        assert s.server is not None
        s.server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        _, body = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()


async def test_sequential_requests_reuse_one_connection(serve) -> None:
    server = await serve(echo_forever)
    pool = http1.Client().pool("127.0.0.1", server.port)
    for i in range(5):
        response = await pool.request("POST", "/x", b'{"i":%d}' % i)
        try:
            assert response.status == 200
            assert await response.read() == b'{"i":%d}' % i
        finally:
            response.close()
    assert server.connections == 1


async def test_a_chunked_body_arrives_piece_by_piece(serve) -> None:
    release = asyncio.Event()

    async def sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata:1\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\ndata:2\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server = await serve(sse)
    response = await http1.Client().pool("127.0.0.1", server.port).request("POST", "/s", b"{}")
    try:
        assert await asyncio.wait_for(response.chunk(), 5) == b"data:1"  # before the rest exists
        release.set()
        assert await asyncio.wait_for(response.chunk(), 5) == b"data:2"
        assert await response.chunk() == b""
    finally:
        response.close()


async def test_closing_a_response_early_drops_the_connection(serve) -> None:
    """That is how a vLLM server learns to abort the request."""
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"6\r\ndata:x\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    server = await serve(endless)
    pool = http1.Client().pool("127.0.0.1", server.port)
    response = await pool.request("POST", "/s", b"{}")
    assert await response.chunk()
    response.close()
    await asyncio.wait_for(server.disconnects.wait(), 5)


async def test_refused_and_lost_connections_are_told_apart(serve) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # got the request, then dies without answering

    server = await serve(hang_up)
    with pytest.raises(http1.ConnectionLost):
        await http1.Client().pool("127.0.0.1", server.port).request("POST", "/x", b"{}")
    port = server.port
    assert server.server is not None
    server.server.close()
    await server.server.wait_closed()
    with pytest.raises(http1.ConnectFailed):
        await http1.Client().pool("127.0.0.1", port).request("POST", "/x", b"{}")


async def test_garbage_instead_of_http_is_a_lost_connection(serve) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await reader.read()

    server = await serve(garbage)
    with pytest.raises(http1.ConnectionLost):
        await http1.Client().pool("127.0.0.1", server.port).request("POST", "/x", b"{}")


async def test_a_cancelled_request_aborts_its_connection(serve) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    server = await serve(silent)
    pool = http1.Client().pool("127.0.0.1", server.port)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await pool.request("POST", "/x", b"{}")
    await asyncio.wait_for(server.disconnects.wait(), 5)


async def test_stale_idle_connections_are_not_reused(serve, monkeypatch) -> None:
    server = await serve(echo_forever)
    pool = http1.Client().pool("127.0.0.1", server.port)
    for _ in range(2):
        response = await pool.request("POST", "/x", b"{}")
        await response.read()
        response.close()
        monkeypatch.setattr(http1, "MAX_IDLE_S", 0.0)  # the next pick finds it too old
    assert server.connections == 2


async def test_header_values_cannot_smuggle_lines(serve) -> None:
    server = await serve(echo_forever)
    pool = http1.Client().pool("127.0.0.1", server.port)
    with pytest.raises(ValueError):
        await pool.request("POST", "/x", b"{}", {"x-request-id": "a\r\nx-evil: 1"})
    assert server.connections == 0


async def test_a_client_with_credentials_sends_them_on_every_request(serve) -> None:
    heads = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            heads.append(head)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()

    server = await serve(record)
    pool = http1.Client("k3y").pool("127.0.0.1", server.port)
    for method, body in (("POST", b"{}"), ("GET", None)):
        response = await pool.request(method, "/x", body, {"x-request-id": "r"})
        response.close()
    assert len(heads) == 2
    for head in heads:
        lines = head.split(b"\r\n")
        assert b"authorization: Bearer k3y" in lines and b"x-request-id: r" in lines
    with pytest.raises(ValueError, match="control character"):
        http1.Client("k\r\nx: y").pool("127.0.0.1", server.port)


@pytest.mark.parametrize("interim", [
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n"])
async def test_an_interim_answer_is_skipped_for_the_one_that_follows(serve, interim) -> None:
    """A 1xx before the answer (some servers and proxies send 100 Continue unasked) is not the
    answer: before, its status was taken as the reply's and its end as the body's."""
    async def early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            _, body = await read_request(reader)
            writer.write(interim)
            await writer.drain()
            await asyncio.sleep(0.01)  # (apart: the answer in its own read)
            writer.write(b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
            await writer.drain()

    server = await serve(early)
    pool = http1.Client().pool("127.0.0.1", server.port)
    for body in (b"first", b"second"):
        response = await pool.request("POST", "/x", body)
        try:
            assert response.status == 201 and await response.read() == body
        finally:
            response.close()
    assert server.connections == 1  # both answers complete: the connection kept


@pytest.mark.parametrize("head", [b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n",
                                  b"HTTP/1.0 200 OK\r\n\r\n"])
async def test_a_body_the_close_delimits_ends_there(serve, head) -> None:
    """No length and no chunks: the body is what comes until the server closes (before, the
    close was a lost connection). The next request opens another connection."""
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head + b"data: one\n\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"data: two\n\n")
        await writer.drain()

    server = await serve(close_delimited)
    pool = http1.Client().pool("127.0.0.1", server.port)
    for _ in range(2):
        response = await pool.request("POST", "/x", b"{}")
        try:
            assert response.status == 200
            assert await asyncio.wait_for(response.read(), 5) == b"data: one\n\ndata: two\n\n"
        finally:
            response.close()
    assert server.connections == 2


async def test_a_body_of_known_length_cut_short_is_still_a_lost_connection(serve) -> None:
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()

    server = await serve(short)
    response = await http1.Client().pool("127.0.0.1", server.port).request("POST", "/x", b"{}")
    try:
        with pytest.raises(http1.ConnectionLost):
            await asyncio.wait_for(response.read(), 5)
    finally:
        response.close()
