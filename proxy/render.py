"""The one place results become HTTP: a Reply is JSON, a Stream is SSE (bytes exactly as the
decode engine framed them, and an in-band error event when it failed mid-stream), a ProxyError
is an OpenAI-style error body with its status (``errors.error_json``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.client_io import ClientGone, HangUpCancels
from proxy.errors import ProxyError, error_json, error_sse
from proxy.orchestrator import Reply, Stream

log = logging.getLogger(__name__)


def error_response(err: ProxyError, request_id: str | None = None) -> Response:
    headers = err.headers()
    if request_id:
        headers["x-request-id"] = request_id
    return Response(error_json(err), status_code=err.status, media_type="application/json",
                    headers=headers)


def render(result: Reply | Stream, on_end: Callable[[], None] | None = None) -> Response:
    """``on_end`` runs once a stream has ended, however it ended (the admission slot)."""
    if isinstance(result, Reply):
        return Response(result.body, status_code=result.status, media_type="application/json",
                        headers=result.headers)
    return EventStream(result.chunks, result.headers, on_end, result.abandon, result.deadline)


class EventStream(Response):
    """A Stream's SSE response: its chunks written as they come (a ProxyError as its in-band
    error event), ended by the stream's end or by the client hanging up.

    Starlette's ``StreamingResponse`` does the same with an anyio task group of two tasks per
    response (uvicorn speaks ASGI 2.3, so it must listen for the disconnect itself); here the
    stream is written from the route's own task, and one watcher task cancels it when the
    client leaves. However the writing ends, the chunks are closed at once (closing the decode
    request: vLLM aborts it), then ``on_end`` runs.

    A client that stops reading (its connection open, its window full) blocks the writes: at
    the request's ``deadline`` (and ``LATE_S`` for the relay's own in-band timeout error to be
    written) the writing stops and the connection is dropped, unfinished."""

    #: How long past the deadline a stream may still be written (the in-band timeout error).
    LATE_S = 1.0

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes | ProxyError], headers: dict[str, str],
                 on_end: Callable[[], None] | None = None,
                 abandon: Callable[[], None] | None = None, deadline: float | None = None):
        self.chunks = chunks
        self.deadline = deadline
        self.on_end = on_end
        #: Ends a stream that was never read (``Stream.abandon``).
        self.abandon = abandon
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        read = False
        try:
            late_at = None if self.deadline is None else self.deadline + self.LATE_S
            async with HangUpCancels(receive), asyncio.timeout_at(late_at):
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                read = True  # the loop starts the chunks' generator at once
                async for item in self.chunks:
                    body = error_sse(item) if isinstance(item, ProxyError) else item
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientGone:
            pass  # nobody to answer; the chunks are closed below
        except TimeoutError:  # (unfinished: the server drops the connection)
            log.warning("a client took its stream past the request's deadline: dropped")
        finally:
            aclose = getattr(self.chunks, "aclose", None)
            try:
                if not read and self.abandon is not None:
                    self.abandon()  # never started: aclose would run none of its cleanup
                elif aclose is not None:
                    await aclose()
            finally:
                if self.on_end is not None:
                    self.on_end()
