"""The proxy app served by uvicorn on a loopback ephemeral port, inside the test's event loop.

For what the in-process ASGI transport cannot do: a client that really hangs up (uvicorn then
reports ``http.disconnect``), raw bytes on the wire (a body that never finishes), and many
concurrent connections. :func:`live_proxy` starts the server (lifespan included) and stops it on
exit; :class:`RawRequest` is one HTTP/1.1 request on its own socket, so a test decides exactly
what is sent and when the client goes away.

uvicorn's signal handlers are left out: the test process keeps its own Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette

from harness.fake_engine import FakeEngine
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.server import uvicorn_config
from proxy.service import ProxyService

#: Upper bound for things that take milliseconds (start-up, a counter catching up). Only a
#: failing test ever waits this long; it is generous because a busy 2-core box can stall a
#: process for seconds.
SETTLE_S = 30.0


def proxy_config(prefill: FakeEngine | None, decode: FakeEngine, **overrides: Any) -> ProxyConfig:
    """The same settings as ``test_proxy_app.proxy``: P/D always, no warm-up, start-up probes
    only."""
    settings: dict[str, Any] = {
        "prefill_urls": (prefill.url,) if prefill is not None else (),
        "decode_urls": (decode.url,),
        "served_model_names": ("m",),
        "policy": "disaggregate",
        "warmup": False,
        "health_interval_s": 3600.0,
        "prefill_deadline_s": 120.0,  # deadlines no test means to reach
        "headers_deadline_s": 120.0,
        "idle_deadline_s": 120.0,
        "total_deadline_s": 300.0,
    }
    return ProxyConfig(**(settings | overrides))


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class LiveProxy:
    app: Starlette
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> ProxyService:
        return self.app.state.pd

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the proxy's registry (0 when the series was never touched)."""
        value = self.state.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def outstanding_tokens(self) -> dict[str, float]:
        """Routing load per engine; all zero once no request is in flight (nothing leaked)."""
        costs = self.state.orchestrator.costs
        return {e.name: costs.load_tokens(e.name) for e in self.state.pool.all()}

    async def wait_for_metric(self, name: str, want: float, **labels: str) -> None:
        """Poll until the sample equals ``want`` (for counters bumped just after an event)."""
        await wait_until(lambda: self.metric(name, **labels) == want,
                         f"{name}{labels} == {want} (is {self.metric(name, **labels)})")


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = SETTLE_S
                     ) -> None:
    """Short polling with a deadline, for state that has no event to wait on."""
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s:g}s: {what}") from None


@contextlib.asynccontextmanager
async def live_proxy(config: ProxyConfig, **app_kwargs: Any) -> AsyncIterator[LiveProxy]:
    """``app_kwargs`` go to ``create_app`` (a directory, a scaler)."""
    app = create_app(config, **app_kwargs)
    server = _Server(uvicorn_config(app, config, "127.0.0.1", 0, lifespan="on",
                                    timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(SETTLE_S):
            while not server.started:
                if task.done():
                    await task  # raises what stopped it
                    raise RuntimeError("uvicorn stopped before it started")
                await asyncio.sleep(0.005)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield LiveProxy(app, "127.0.0.1", port)
    finally:
        server.should_exit = True
        await task


class RawRequest:
    """One POST on its own connection: send it (or part of it), read the answer, hang up."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.received = b""

    @classmethod
    async def send(
        cls,
        proxy: LiveProxy,
        path: str,
        body: bytes | dict[str, Any],
        *,
        content_length: int | None = None,
    ) -> RawRequest:
        """Send the head and ``body``; ``content_length`` may declare more than is sent."""
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        length = len(raw) if content_length is None else content_length
        head = (f"POST {path} HTTP/1.1\r\nhost: {proxy.host}:{proxy.port}\r\n"
                f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n")
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        writer.write(head.encode() + raw)
        await writer.drain()
        return cls(reader, writer)

    async def status(self, timeout_s: float = SETTLE_S) -> int:
        """The status code from the status line (waits for it at most ``timeout_s``)."""
        async with asyncio.timeout(timeout_s):
            line = await self.reader.readline()
        self.received += line
        parts = line.split()
        assert len(parts) >= 2 and parts[0].startswith(b"HTTP/1."), line
        return int(parts[1])

    async def head_and_body(self, timeout_s: float = SETTLE_S) -> tuple[dict[str, str], bytes]:
        """After :meth:`status`: the headers, then a ``content-length`` body."""
        headers: dict[str, str] = {}
        async with asyncio.timeout(timeout_s):
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return headers, body

    async def read_until(self, marker: bytes, timeout_s: float = SETTLE_S) -> bytes:
        """Read (headers and chunked body alike) until ``marker`` has arrived."""
        async with asyncio.timeout(timeout_s):
            while marker not in self.received:
                chunk = await self.reader.read(65536)
                assert chunk, f"connection closed before {marker!r}: {self.received!r}"
                self.received += chunk
        return self.received

    async def hang_up(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()
