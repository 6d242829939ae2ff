"""HTTP client for one vLLM engine's OpenAI server, on the proxy's keep-alive pools
(:mod:`proxy.http1`).

Call order: ``post_json()`` for a whole reply, or ``open_stream()`` then iterate ``chunks()`` and
``close()`` exactly once (``close`` is idempotent; the caller owns it, in a ``finally``). Closing a
stream before it ends drops the connection, which is how vLLM's server learns to abort the request
and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from proxy import http1


class EngineUnreachable(Exception):
    """The engine could not be reached or dropped the connection.

    ``delivered`` is False only when no connection was made (the request surely never reached
    the engine); otherwise the engine may have seen, and begun, the request."""

    def __init__(self, message: str, delivered: bool = True):
        super().__init__(message)
        self.delivered = delivered


def _unreachable(name: str, exc: http1.HttpError) -> EngineUnreachable:
    return EngineUnreachable(f"{name}: {exc}",
                             delivered=not isinstance(exc, http1.ConnectFailed))


class EngineTimeout(Exception):
    """The engine did not answer within the stage's deadline."""


@dataclass(frozen=True)
class EngineReply:
    status: int
    body: bytes

    def json(self) -> Any:
        try:
            return _decode(self.body)
        except msgspec.DecodeError:  # not strict JSON (e.g. a NaN literal): Python's parser
            return json.loads(self.body)


class EngineStream:
    """An open streaming response; iterate :meth:`chunks`, then :meth:`close` (the abort)."""

    def __init__(self, name: str, response: http1.Response, idle_s: float):
        self._name = name
        self._response = response
        self._idle_s = idle_s
        #: Closed by :meth:`move`: the relay's failure then says nothing of the engine.
        self.moved = False

    @property
    def status(self) -> int:
        return self._response.status

    async def read_all(self) -> bytes:
        try:
            return await self._response.read()
        except http1.HttpError as exc:
            raise _unreachable(self._name, exc) from exc

    async def read_and_close(self) -> bytes:
        """The (error) body, within ``idle_s``: an engine that stalls in it gives none (its
        status says what happened)."""
        try:
            async with asyncio.timeout(self._idle_s):
                return await self.read_all()
        except TimeoutError:
            return b""
        finally:
            self.close()

    async def chunks(self, deadline: float | None = None) -> AsyncIterator[bytes]:
        """Yield body bytes as they arrive; raise EngineTimeout after ``idle_s`` of silence, and
        TimeoutError at ``deadline`` (``loop.time()``: the whole request's)."""
        response, loop = self._response, asyncio.get_running_loop()
        while True:
            now = loop.time()
            if deadline is not None and now >= deadline:
                # (A read of bytes already buffered never waits: a client slower than the
                # engine would never see the timer fire.)
                raise TimeoutError("the request's deadline passed")
            idle_at = now + self._idle_s
            try:
                # A timer per read: the time the consumer takes with a chunk is not counted, and
                # the timer cancels this read only (never the consumer, between reads).
                async with asyncio.timeout_at(idle_at if deadline is None
                                              else min(idle_at, deadline)):
                    chunk = await response.chunk()
            except TimeoutError as exc:
                if deadline is not None and deadline <= idle_at:
                    raise  # the request's own deadline
                raise EngineTimeout("engine stream went silent") from exc
            except http1.HttpError as exc:
                raise _unreachable(self._name, exc) from exc
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        self._response.close()

    def move(self) -> None:
        """Close the stream so that its relay continues it on another engine, this one not at
        fault (a drain past its timeout: ``proxy/scale_down.py``)."""
        self.moved = True
        self.close()


class EngineClient:
    """One engine endpoint (``base_url`` like ``http://127.0.0.1:8100``)."""

    def __init__(self, name: str, base_url: str, session: http1.Client):
        self.name = name
        self.base_url = base_url.rstrip("/")
        url = urlsplit(self.base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"engine URL must be http://host:port, got {base_url!r}")
        self._prefix = url.path
        self._address = (url.hostname, url.port or 80)
        self._pool = session.pool(*self._address)

    def __repr__(self) -> str:
        return f"EngineClient({self.name!r}, {self.base_url!r})"

    async def post_json(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> EngineReply:
        """POST ``body`` and read the whole reply within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._pool.request("POST", self._prefix + path, _dumps(body),
                                                    headers)
                try:
                    return EngineReply(response.status, await response.read())
                finally:
                    response.close()
        except TimeoutError as exc:
            raise EngineTimeout(f"{self.name} did not answer within {timeout_s:g}s") from exc
        except http1.HttpError as exc:
            raise _unreachable(self.name, exc) from exc

    async def open_stream(
        self,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        headers_s: float,
        idle_s: float,
    ) -> EngineStream:
        """POST ``body`` and return once response headers arrived (within ``headers_s``)."""
        try:
            async with asyncio.timeout(headers_s):
                response = await self._pool.request("POST", self._prefix + path, _dumps(body),
                                                    headers)
        except TimeoutError as exc:
            raise EngineTimeout(
                f"{self.name} did not start answering in {headers_s:g}s") from exc
        except http1.HttpError as exc:
            raise _unreachable(self.name, exc) from exc
        return EngineStream(self.name, response, idle_s)

    async def get_text(self, path: str, timeout_s: float) -> tuple[int, str]:
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._pool.request("GET", self._prefix + path)
                try:
                    return response.status, (await response.read()).decode(errors="replace")
                finally:
                    response.close()
        except TimeoutError as exc:
            raise EngineTimeout(f"{self.name} {path} timed out") from exc
        except http1.HttpError as exc:
            raise _unreachable(self.name, exc) from exc

    async def connects(self, timeout_s: float) -> bool:
        """Whether a new TCP connection to the engine opens within ``timeout_s`` (closed at
        once). A busy engine's kernel accepts one even while its server is slow to answer; a
        host cut off from this one does not."""
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(*self._address)
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True


_decode = msgspec.json.Decoder().decode
#: Bodies sent to engines come from strictly parsed client JSON (``requests.parse_body``) plus
#: our own finite values, so msgspec (several times faster than ``json`` on the token-id lists
#: of long prompts, on every hand-off) encodes them all.
_dumps: Callable[[Any], bytes] = msgspec.json.Encoder().encode


def new_session(engine_key: str | None = None) -> http1.Client:
    """The one set of keep-alive pools a proxy process uses for all engines (each request
    carries the deployment's ``engine_key``)."""
    return http1.Client(engine_key)
