"""One HTTP/1.1 response as ``proxy/http1.py``'s connections deliver it: its status, then its
body as it arrives (read by the caller, buffered up to a high-water mark), and the two ways a
call fails."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.http1 import _Connection

#: Stop reading from the socket while this much of a response waits for its consumer.
_HIGH_WATER = 1 << 20


class HttpError(Exception):
    """The engine could not be reached or its connection failed."""


class ConnectFailed(HttpError):
    """No connection could be made: the request was not sent."""


class ConnectionLost(HttpError):
    """The connection dropped, or the answer was not HTTP: the request may have arrived."""


class Response:
    """One response: its status, then its body as it arrives."""

    def __init__(self, conn: _Connection):
        self._conn = conn
        self.status = 0
        self.keep_alive = False
        self._headers_in: asyncio.Future[None] = conn.loop.create_future()
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._error: HttpError | None = None
        self._closed = False

    # -- consumer side -----------------------------------------------------------------------
    async def chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); ``b""`` at the
        end. Raises ConnectionLost if the connection failed first."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        self._chunks.clear()
        if self._buffered > _HIGH_WATER:
            self._conn.resume_reading()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.chunk():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Done with it: a complete response frees its connection, an incomplete one aborts."""
        if self._closed:
            return
        self._closed = True
        self._conn.finished(self, reusable=self._complete and self.keep_alive
                            and self._error is None)

    # -- connection side ---------------------------------------------------------------------
    def _on_headers(self, status: int, keep_alive: bool) -> None:
        self.status = status
        self.keep_alive = keep_alive
        if not self._headers_in.done():
            self._headers_in.set_result(None)

    def _on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _on_complete(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: HttpError) -> None:
        if self._complete:
            return
        self._error = error
        if not self._headers_in.done():
            self._headers_in.set_exception(error)
            self._headers_in.exception()  # retrieved: nobody may be waiting any more
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
