"""The one place results become HTTP: a Reply is JSON, a Stream is SSE (bytes exactly as the
decode engine framed them, and an in-band error event when it failed mid-stream), a ProxyError
is an OpenAI-style error body with its status (``errors.error_json``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.errors import ProxyError, error_json, error_sse
from proxy.orchestrator import Reply, Stream


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
    return EventStream(sse(result.chunks, on_end), result.headers)


class EventStream(Response):
    """An SSE response from an async iterator of bytes, ended by the client hanging up.

    Starlette's ``StreamingResponse`` does the same with an anyio task group of two tasks per
    response (uvicorn speaks ASGI 2.3, so it must listen for the disconnect itself); here the
    stream is written from the route's own task, and one watcher task cancels it when the
    client leaves: the cancellation closes the chunks' generators, and so the decode request
    (vLLM aborts it)."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[bytes, None], headers: dict[str, str]):
        self.body_iterator = chunks
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not (gone and current.uncancel() == 0):
                raise  # cancelled for another reason (shutdown): not ours to swallow
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()  # whatever ended the writing (the client gone
            # while a chunk was being sent included), the engine's stream is closed now


async def sse(chunks: AsyncIterator[bytes | ProxyError], on_end: Callable[[], None] | None
              ) -> AsyncGenerator[bytes, None]:
    try:
        async for item in chunks:
            yield error_sse(item) if isinstance(item, ProxyError) else item
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
        if on_end is not None:
            on_end()
