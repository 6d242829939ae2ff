"""The client's side of a request: reading its body within limits, noticing when it leaves.

``read_body`` enforces the size limit while reading (a declared or actual body over the limit is
refused without buffering it) and a deadline for the whole body. ``serve_unless_disconnected``
runs the orchestrator while listening for the client hanging up; on a hang-up it cancels the
work (closing engine connections, which makes vLLM abort and free the request's KV) and raises
``ClientGone``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

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


async def serve_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - the work is abandoned; its cleanup ran
        pass
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
