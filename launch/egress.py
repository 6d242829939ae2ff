"""A node's way out to the package registries: an HTTP ``CONNECT`` proxy on the host side of a
testbed link.

A namespace node (``launch/ssh_node.py``) has one route, its veth to the host, and no NAT (this
machine has no ``iptables``). Its ``make setup`` still needs PyPI, as any node's does. Its pip is
given ``PIP_PROXY=http://<host_addr>:<port>`` and tunnels through this proxy; nothing else on the
node uses it (Ray's gRPC would honour ``https_proxy``, so that is not set).

Only ``CONNECT`` is served (pip speaks HTTPS), to ports 443 and 80 (``ports``), from the link's
own subnet (``clients``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import threading

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0
HEADER_TIMEOUT_S = 10.0
ALLOWED_PORTS = (80, 443)


class EgressProxy:
    """``with EgressProxy(host, port, clients) as proxy:`` a CONNECT proxy on ``host:port`` for
    peers in ``clients`` (a network), served from a thread of its own; ``proxy.url`` for pip."""

    def __init__(self, host: str, port: int, clients: ipaddress.IPv4Network,
                 ports: tuple[int, ...] = ALLOWED_PORTS) -> None:
        self.host, self.port, self.clients, self.ports = host, port, clients, ports
        self.tunnels = 0  # CONNECTs served, for tests and logs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="egress",
                                        daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EgressProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, self.host, self.port), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._server is not None:  # closed on its loop: asyncio's Server is not thread-safe
            asyncio.run_coroutine_threadsafe(_close(self._server), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> EgressProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[0]
        try:
            if ipaddress.ip_address(peer) not in self.clients:
                return await _refuse(writer, b"403 Forbidden")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT_S)
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            host, _, port = target.rpartition(":")
            if method != "CONNECT" or not port.isdigit() or int(port) not in self.ports:
                return await _refuse(writer, b"405 Method Not Allowed")
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(host, int(port)), CONNECT_TIMEOUT_S)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                asyncio.TimeoutError) as e:
            log.debug("egress: refused %s: %r", peer, e)
            return await _refuse(writer, b"502 Bad Gateway")
        self.tunnels += 1
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _close(server: asyncio.base_events.Server) -> None:
    # (Closed from the caller's thread, it raced the loop's own wake-up of the server's waiters
    # when its last connection ended: "'NoneType' object is not iterable", a failed CI run.)
    server.close()
    await server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.close()


async def _refuse(writer: asyncio.StreamWriter, status: bytes) -> None:
    with contextlib.suppress(OSError):
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()
