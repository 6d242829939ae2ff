"""The client's side of a request: reading its body within limits, noticing when it leaves.

``read_body`` enforces the size limit while reading (a declared or actual body over the limit is
refused without buffering it) and a deadline for the whole body. ``HangUpCancels`` runs a
piece of the response (the orchestrator's work: ``serve_unless_disconnected``; writing a
stream: ``render.EventStream``) while listening for the client hanging up; on a hang-up it
cancels the work (closing engine connections, which makes vLLM abort and free the request's
KV) and raises ``ClientGone``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from proxy.errors import PayloadTooLarge, RequestTimeout

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before a response could be sent."""


async def read_body(request: Request, limit_bytes: int, deadline_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise PayloadTooLarge(f"request body is over the {limit_bytes} byte limit")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(deadline_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit_bytes:
                    raise PayloadTooLarge(f"request body is over the {limit_bytes} byte limit")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {deadline_s:g}s") from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


async def serve_unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` in this task; if the client hangs up first, cancel it and raise ClientGone.

    The work runs in the calling task (no task hop on the request's critical path)."""
    async with HangUpCancels(request.receive):
        return await work


class HangUpCancels:
    """``async with HangUpCancels(receive):`` the body runs in the calling task while one
    watcher task listens for the client hanging up (``receive``: the ASGI channel); a hang-up
    cancels the body and raises ClientGone in its place. Any other cancellation (server
    shutdown) stays a cancellation. (A class, not a generator-based context manager: it is on
    every request's path twice.)"""

    __slots__ = ("_receive", "_task", "_gone", "_watcher")

    def __init__(self, receive: Receive):
        self._receive = receive
        self._gone = False
        self._watcher: asyncio.Task | None = None

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._gone = True
        self._task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        # Not kept: the cancelled watcher's exception holds its frame, which holds this object
        # (a reference cycle per request, left to the garbage collector).
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError) and (
                self._gone and self._task.uncancel() == 0):
            raise ClientGone() from None
