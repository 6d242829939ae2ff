"""The client's side of a request: reading its body within limits, noticing when it leaves.

``read_body`` enforces the size limit while reading (a declared or actual body over the limit is
refused without buffering it) and a deadline for the whole body. ``hang_up_cancels`` runs a
piece of the response (the orchestrator's work: ``serve_unless_disconnected``; writing a
stream: ``render.EventStream``) while listening for the client hanging up; on a hang-up it
cancels the work (closing engine connections, which makes vLLM abort and free the request's
KV) and raises ``ClientGone``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
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
    async with hang_up_cancels(request.receive):
        return await work
    raise AssertionError("unreachable")  # mypy: the context manager swallows nothing


@asynccontextmanager
async def hang_up_cancels(receive: Receive) -> AsyncIterator[None]:
    """The body runs in the calling task while one watcher task listens for the client hanging
    up (``receive``: the ASGI channel); a hang-up cancels the body and raises ClientGone in its
    place. Any other cancellation (server shutdown) stays a cancellation."""
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        current.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:
            raise ClientGone() from None
        raise  # cancelled for another reason (shutdown): not ours to swallow
    finally:
        watcher.cancel()
