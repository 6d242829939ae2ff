"""Serving the proxy app with uvicorn, plus what uvicorn lacks: a deadline on request headers.

uvicorn closes idle keep-alive connections but lets a client take forever to send a request's
headers (slow-loris: thousands of half-open requests pin sockets and memory). The ASGI app
cannot help: it only runs once the headers are complete. :class:`HeaderDeadlineH11Protocol`
arms a timer when a request's first bytes arrive and disarms it when its headers are parsed;
a client that misses it gets a 408 with an OpenAI-style body and the connection is closed.
The body has its own deadline in ``client_io.read_body``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from proxy.config import ProxyConfig
from proxy.errors import RequestTimeout, error_json


class HeaderDeadlineH11Protocol(H11Protocol):
    """H11Protocol with a deadline from a request's first byte to its last header byte."""

    header_deadline_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._seen_cycle: Any = None
        self._arm()  # a connection that sends nothing at all is a slow client too

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of the next request on this connection
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._seen_cycle:
            self._seen_cycle = self.cycle  # headers parsed: the app has the request now
            self._disarm()

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
        if self.transport.is_closing():
            return
        body = error_json(RequestTimeout(
            f"request headers not received within {self.header_deadline_s:g}s"))
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)
        self.transport.close()


def uvicorn_config(app: FastAPI, config: ProxyConfig, host: str, port: int,
                   **overrides: Any) -> uvicorn.Config:
    """The one way the proxy is served (dev mode, Ray mode, tests)."""
    protocol = type("H11WithHeaderDeadline", (HeaderDeadlineH11Protocol,),
                    {"header_deadline_s": config.header_read_deadline_s})
    settings: dict[str, Any] = dict(
        host=host, port=port, http=protocol, log_level="warning", access_log=False,
        timeout_keep_alive=30, timeout_graceful_shutdown=10,
    )
    return uvicorn.Config(app, **(settings | overrides))
