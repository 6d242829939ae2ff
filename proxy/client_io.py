"""The client's side of a request: reading its body within limits, noticing when it leaves.

``read_body`` enforces the size limit while reading (a declared or actual body over the limit is
refused without buffering it) and a deadline for the whole body. ``serve_unless_disconnected``
runs the orchestrator while listening for the client hanging up; on a hang-up it cancels the
work (closing engine connections, which makes vLLM abort and free the request's KV) and raises
``ClientGone``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request

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

    The work runs in the calling task (no task hop on the request's critical path); one
    watcher task listens for the disconnect and cancels this task when it comes."""
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request)
        gone = True
        current.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:
            raise ClientGone() from None
        raise  # cancelled for another reason (shutdown): not ours to swallow
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
