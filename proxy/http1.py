"""A small HTTP/1.1 client for the proxy's engine calls: keep-alive connections per engine,
responses parsed by httptools (the C parser uvicorn uses), nothing else.

Why not aiohttp: its request path cost ~65 µs of CPU per call more than a bare protocol
(measured warm, client and server on one loopback box), and every proxied request makes two
engine calls on its critical path. What the proxy needs is narrow: JSON POSTs, chunked SSE
responses read as they arrive, GETs for probes, and closing a response early to abort it.

Call order: ``await pool.request(...)`` returns once the status line and headers are in; then
``await response.chunk()`` until it returns ``b""`` (or ``await response.read()``), and
``response.close()`` exactly once, in a ``finally``. Closing a response that has not ended
closes its connection, which is how vLLM's server learns to abort the request; a response read
to its end hands its connection back for the next request.

An interim answer (``1xx``: 100 Continue, 103 Early Hints) is skipped for the one that follows;
a body with neither a length nor chunks ends where the server closes the connection (an HTTP/1.0
answer, some proxies in between: vLLM's server sends neither).

Errors: :class:`ConnectFailed` (no connection was made: the request surely never arrived) and
:class:`ConnectionLost` (the connection dropped or answered garbage: it may have arrived).
Deadlines are the caller's (``asyncio.timeout``); a cancelled request closes its connection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import httptools

from proxy.http1_response import ConnectFailed, ConnectionLost, HttpError, Response

__all__ = ["Client", "ConnectFailed", "ConnectionLost", "HttpError", "Pool", "Response"]

#: Idle connections older than this are not reused: vLLM's server closes keep-alive
#: connections after 5 s idle, and a request written into one it is closing would be lost.
MAX_IDLE_S = 4.0
#: The headers that frame a body (without either, the close ends it).
_FRAMING = (b"content-length", b"transfer-encoding")
_FRAMING_LENGTHS = {len(h) for h in _FRAMING}


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.lost = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._paused = False
        self._interim = False  # reading a 1xx answer: the real one follows
        self._framed = False  # the answer has a length or chunks (else the close ends it)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing asked: a server talking out of turn
            self.abort()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lose(ConnectionLost(f"bad HTTP from the engine: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        r = self.response
        if r is not None and exc is None and r.status and not (self._framed or self._interim):
            r._on_complete()  # a body the close delimits: this is its end
        self._lose(ConnectionLost(f"connection lost: {exc or 'closed by the engine'}"))

    # httptools callbacks
    def on_header(self, name: bytes, _value: bytes) -> None:
        if len(name) in _FRAMING_LENGTHS and name.lower() in _FRAMING:
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._interim, self._framed = True, False
        elif self.response is not None:
            self.response._on_headers(status, self._parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._on_body(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        elif self.response is not None:
            self.response._on_complete()

    # used by Pool and Response
    def send(self, data: bytes, response: Response) -> None:
        assert self.transport is not None
        self.response = response
        self._framed = False
        self.transport.write(data)

    def finished(self, response: Response, reusable: bool) -> None:
        if response is not self.response:
            return
        if reusable and not self.lost:
            self.response = None
            self.resume_reading()
            self.pool.release(self)
        else:  # closing mid-answer is the abort; a spent connection is closed too
            self.abort()

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()
        self.pool.discard(self)

    def _lose(self, error: HttpError) -> None:
        self.lost = True
        if self.response is not None:
            self.response._fail(error)
        self.pool.discard(self)
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to one ``host:port``; no cap on how many are open at once."""

    def __init__(self, host: str, port: int, auth: str | None = None):
        self.host, self.port = host, port
        if auth and not auth.isprintable():
            raise ValueError("the credentials contain a line break or another control character")
        auth_line = f"authorization: Bearer {auth}\r\n" if auth else ""
        self._fixed_headers = f"host: {host}:{port}\r\n{auth_line}".encode()
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None,
                      content_type: str = "application/json") -> Response:
        """Send one request; return once the response's headers are in."""
        head = [f"{method} {path} HTTP/1.1\r\n".encode(), self._fixed_headers]
        if body is not None:
            head.append(f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
                        .encode())
        for name, value in (headers or {}).items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise ValueError(f"header {name!r} contains a line break")
            head.append(f"{name}: {value}\r\n".encode())
        head.append(b"\r\n")
        if body:
            head.append(body)
        conn = self._idle_connection() or await self._connect()
        response = Response(conn)
        conn.send(b"".join(head), response)
        try:
            await response._headers_in
        except BaseException:
            response.close()  # cancelled or failed before the headers: abort
            raise
        return response

    def _idle_connection(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost and now - conn.idle_since < MAX_IDLE_S:
                return conn
            conn.abort()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host,
                                                   self.port)
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        self._all.add(conn)
        return conn

    def release(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def discard(self, conn: _Connection) -> None:
        self._all.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> None:
        for conn in list(self._all):
            conn.abort()


class Client:
    """The process's pools, one per engine address; requests carry ``auth`` as bearer token."""

    def __init__(self, auth: str | None = None) -> None:
        self._pools: dict[tuple[str, int], Pool] = {}
        self._auth = auth

    def pool(self, host: str, port: int) -> Pool:
        key = (host, port)
        if key not in self._pools:
            self._pools[key] = Pool(host, port, self._auth)
        return self._pools[key]

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        await asyncio.sleep(0)  # let the transports finish closing
