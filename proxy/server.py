"""Serving the proxy app with uvicorn, plus what uvicorn lacks: limits on request heads.

The proxy speaks HTTP/1.1 through uvicorn's httptools protocol (a C parser; uvicorn's h11
protocol cost the proxy about 0.15 ms of CPU more per request, measured in
``benchmarks/proxy_overhead.py``). uvicorn closes idle keep-alive connections but lets a client
take forever to send a request's head (slow-loris: thousands of half-open requests pin sockets
and memory), and with httptools it puts no cap on the head's size. The ASGI app cannot help: it
only runs once the head is complete. :class:`GuardedHttpToolsProtocol` adds both:

- a deadline, armed when a request's first bytes arrive (or the connection opens) and disarmed
  when its headers are parsed: a client that misses it gets a 408;
- a cap on the bytes of a head still incomplete: a client over it gets a 431;
- a request the parser refuses (a control character in a header value) gets a 400.

All answer with an OpenAI-style body and close the connection. The body has its own limits in
``client_io.read_body``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.config import ProxyConfig
from proxy.errors import (
    ClientError,
    HeadersTooLarge,
    InvalidRequest,
    RequestTimeout,
    error_json,
)

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size cap on each request head."""

    header_deadline_s: float = 10.0
    max_head_bytes: int = 32 * 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # a request head is (or may start) arriving
        self._head_bytes = 0
        self._arm()  # a connection that sends nothing at all is a slow client too

    def data_received(self, data: bytes) -> None:
        if self._in_head and self._header_timer is None:
            self._arm()
        super().data_received(data)  # parser callbacks below run inside this call
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(HeadersTooLarge(
                    f"request headers are over the {self.max_head_bytes} byte limit"))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        if self._header_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False  # the app has the request now
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_deadline_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        self._refuse(RequestTimeout(
            f"request headers not received within {self.header_deadline_s:g}s"))

    def send_400_response(self, msg: str) -> None:
        """What the HTTP parser refuses (a control character in a header, a broken request
        line) gets the same OpenAI-style body as everything else, not uvicorn's plain text."""
        del msg
        self._refuse(InvalidRequest("malformed HTTP request: the request line or a header "
                                    "is not valid HTTP/1.1"))

    def _refuse(self, err: ClientError) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        body = error_json(err)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % (err.status, _REASONS[err.status], len(body))
            + body)
        self.transport.close()


def uvicorn_config(app: ASGIApp, config: ProxyConfig, host: str, port: int,
                   **overrides: Any) -> uvicorn.Config:
    """The one way the proxy is served (dev mode, Ray mode, tests)."""
    protocol = type("GuardedHttpTools", (GuardedHttpToolsProtocol,),
                    {"header_deadline_s": config.header_read_deadline_s})
    settings: dict[str, Any] = dict(
        host=host, port=port, http=protocol, log_level="warning", access_log=False,
        timeout_keep_alive=30, timeout_graceful_shutdown=10,
    )
    return uvicorn.Config(app, **(settings | overrides))
