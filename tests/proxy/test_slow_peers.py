"""No peer holds a request past its deadline: a client that reads slower than the engine
writes, or stops reading with its connection open; an engine that stalls inside its error
body. Each holds an admission slot, a claim and an engine request otherwise. (A raw engine on
a socket: the fake engine cannot stall mid-body.)"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest

from harness.live_proxy import live_proxy, proxy_config

EVENT = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
         b'"choices":[{"index":0,"delta":{"content":"%s"},"logprobs":null,'
         b'"finish_reason":null}]}\n\n')
CHAT = b"/v1/chat/completions"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return head


def raw_engine(answer: Handler) -> Handler:
    """Answers ``/health`` probes; ``answer`` writes the reply to each POST."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await read_request(reader)
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                await answer(reader, writer)
                return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
    return serve


async def started(handler: Handler) -> tuple[asyncio.Server, SimpleNamespace]:
    server = await asyncio.start_server(raw_engine(handler), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, SimpleNamespace(url=f"http://127.0.0.1:{port}")


def chat(stream: bool, max_tokens: int = 4) -> bytes:
    body = json.dumps({"model": "m", "stream": stream, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (CHAT, len(body), body))


DEADLINES = {"headers_deadline_s": 1.0, "idle_deadline_s": 1.0, "total_deadline_s": 2.0,
             "policy": "local", "migration_limit": 0}


async def test_a_client_that_stops_reading_does_not_hold_its_stream_past_the_deadline():
    engine_saw_close = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        closed = asyncio.ensure_future(reader.read())
        closed.add_done_callback(lambda _: engine_saw_close.set())
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        event = EVENT % (b"x" * 65000)
        while not engine_saw_close.is_set():
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.001)

    server, engine = await started(endless)
    async with live_proxy(proxy_config(None, engine, **DEADLINES)) as lp:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (lp.host, lp.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        reader._transport.pause_reading()  # type: ignore[attr-defined]  # stops reading
        writer.write(chat(stream=True, max_tokens=100_000))
        await writer.drain()
        async with asyncio.timeout(8):  # the total deadline is 2 s
            await engine_saw_close.wait()  # the engine's request was closed (vLLM aborts it)
            while lp.state.admission.inflight:
                await asyncio.sleep(0.01)
        writer.close()
    server.close()


async def test_a_client_slower_than_the_engine_gets_the_timeout_at_the_deadline():
    """Every read finds bytes already buffered: the deadline is checked before each."""
    async def fast(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for _ in range(2000):  # 10 s of tokens, one per 5 ms
            event = EVENT % b"x"
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.005)
        await reader.read()

    server, engine = await started(fast)
    async with live_proxy(proxy_config(None, engine, **DEADLINES)) as lp:
        reader, writer = await asyncio.open_connection(lp.host, lp.port)
        writer.write(chat(stream=True, max_tokens=100_000))
        await writer.drain()
        got = b""
        async with asyncio.timeout(8):
            while chunk := await reader.read(256):  # slowly: 256 bytes per 20 ms
                got += chunk
                await asyncio.sleep(0.02)
                if b"timeout_error" in got:
                    break
        assert b"timeout_error" in got
        writer.close()
    server.close()


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("status", [400, 500])
async def test_an_engine_that_stalls_in_its_error_body_is_not_waited_on(stream, status):
    async def stalled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 %d Err\r\ncontent-type: application/json\r\n"
                     b"content-length: 200\r\n\r\n{\"error\":" % status)
        await writer.drain()
        await reader.read()  # the rest of the body never comes

    server, engine = await started(stalled)
    async with live_proxy(proxy_config(None, engine, **DEADLINES)) as lp:
        reader, writer = await asyncio.open_connection(lp.host, lp.port)
        writer.write(chat(stream))
        await writer.drain()
        async with asyncio.timeout(6):
            line = await reader.readline()
        assert line.startswith(b"HTTP/1.1 %d" % (400 if status == 400 else 502)), line
        writer.close()
        async with asyncio.timeout(6):
            while lp.state.admission.inflight:
                await asyncio.sleep(0.01)
    server.close()


async def test_the_deadline_is_checked_before_a_read_that_would_not_wait():
    """A client slower than the engine: every read finds bytes already buffered, so a timer
    around the read never fires. The deadline is checked before each."""
    from proxy.engine_client import EngineStream

    class Buffered:  # an http1.Response whose bytes are all in
        status = 200

        async def chunk(self) -> bytes:
            return b"data: x\n\n"

    stream = EngineStream("d0", Buffered(), idle_s=30.0)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError):
        async for _ in stream.chunks(deadline=t0 + 0.2):
            await asyncio.sleep(0.05)  # the client takes 50 ms per write
            assert loop.time() - t0 < 3, "read on past the deadline"


async def test_a_whole_reply_longer_than_the_headers_deadline_is_not_cut():
    """vLLM sends a whole reply's headers with its last token: the request's deadline bounds
    it, not the headers deadline (a long answer is no stalled engine)."""
    reply = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
                        "choices": [{"index": 0, "message": {"role": "assistant",
                                                             "content": "ok"},
                                     "finish_reason": "stop"}]}).encode()

    async def slow_whole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(1.6)  # past the headers deadline (1 s), within the total (4 s)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(reply), reply))
        await writer.drain()
        await reader.read()

    server, engine = await started(slow_whole)
    config = proxy_config(None, engine, **(DEADLINES | {"total_deadline_s": 4.0}))
    async with live_proxy(config) as lp:
        reader, writer = await asyncio.open_connection(lp.host, lp.port)
        writer.write(chat(stream=False))
        await writer.drain()
        async with asyncio.timeout(8):
            line = await reader.readline()
        assert line.startswith(b"HTTP/1.1 200"), line
        writer.close()
    server.close()
