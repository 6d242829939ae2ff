"""HTTP client for one vLLM engine's OpenAI server, on one long-lived pooled aiohttp session.

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

import aiohttp
import msgspec


class EngineUnreachable(Exception):
    """The engine could not be reached or dropped the connection.

    ``delivered`` is False only when no connection was made (the request surely never reached
    the engine); otherwise the engine may have seen, and begun, the request."""

    def __init__(self, message: str, delivered: bool = True):
        super().__init__(message)
        self.delivered = delivered


def _unreachable(name: str, exc: BaseException) -> EngineUnreachable:
    return EngineUnreachable(f"{name}: {type(exc).__name__}",
                             delivered=not isinstance(exc, aiohttp.ClientConnectorError))


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

    def __init__(self, response: aiohttp.ClientResponse, idle_s: float):
        self._response = response
        self._idle_s = idle_s
        self._closed = False

    @property
    def status(self) -> int:
        return self._response.status

    async def read_all(self) -> bytes:
        return await self._response.read()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Yield body bytes as they arrive; raise EngineTimeout after ``idle_s`` of silence."""
        content = self._response.content
        while True:
            try:
                # A timer per read (no task per read, as ``wait_for`` would make); the time
                # the consumer takes with a chunk is not counted.
                async with asyncio.timeout(self._idle_s):
                    chunk = await content.readany()
            except TimeoutError as exc:
                raise EngineTimeout("engine stream went silent") from exc
            except (aiohttp.ClientError, ConnectionError) as exc:
                raise EngineUnreachable(str(exc) or type(exc).__name__) from exc
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._response.close()


class EngineClient:
    """One engine endpoint (``base_url`` like ``http://127.0.0.1:8100``)."""

    def __init__(self, name: str, base_url: str, session: aiohttp.ClientSession):
        self.name = name
        self.base_url = base_url.rstrip("/")
        self._session = session

    def __repr__(self) -> str:
        return f"EngineClient({self.name!r}, {self.base_url!r})"

    async def post_json(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str], timeout_s: float
    ) -> EngineReply:
        """POST ``body`` and read the whole reply within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.post(
                    self.base_url + path, data=_dumps(body), headers=_json_headers(headers)
                ) as resp:
                    return EngineReply(resp.status, await resp.read())
        except TimeoutError as exc:
            raise EngineTimeout(f"{self.name} did not answer within {timeout_s:g}s") from exc
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise _unreachable(self.name, exc) from exc

    async def open_stream(
        self,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        first_byte_s: float,
        idle_s: float,
    ) -> EngineStream:
        """POST ``body`` and return once response headers arrived (within ``first_byte_s``)."""
        try:
            async with asyncio.timeout(first_byte_s):
                resp = await self._session.post(
                    self.base_url + path, data=_dumps(body), headers=_json_headers(headers)
                )
        except TimeoutError as exc:
            raise EngineTimeout(f"{self.name} did not start answering in {first_byte_s:g}s") from exc
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise _unreachable(self.name, exc) from exc
        return EngineStream(resp, idle_s)

    async def get_text(self, path: str, timeout_s: float) -> tuple[int, str]:
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.get(self.base_url + path) as resp:
                    return resp.status, await resp.text()
        except TimeoutError as exc:
            raise EngineTimeout(f"{self.name} {path} timed out") from exc
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise _unreachable(self.name, exc) from exc


_decode = msgspec.json.Decoder().decode
#: Bodies sent to engines come from strictly parsed client JSON (``requests.parse_body``) plus
#: our own finite values, so msgspec (several times faster than ``json`` on the token-id lists
#: of long prompts, on every hand-off) encodes them all.
_dumps: Callable[[Any], bytes] = msgspec.json.Encoder().encode


def _json_headers(extra: Mapping[str, str]) -> dict[str, str]:
    return {"content-type": "application/json", **extra}


def new_session() -> aiohttp.ClientSession:
    """The one pooled session a proxy process uses for all engines (keep-alive, no global cap)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    # Engines set no cookies: a dummy jar skips a cookie lookup on every request.
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                 cookie_jar=aiohttp.DummyCookieJar())
