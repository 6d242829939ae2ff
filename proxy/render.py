"""The one place results become HTTP: a Reply is JSON, a Stream is SSE (bytes exactly as the
decode engine framed them, and an in-band error event when it failed mid-stream), a ProxyError
is an OpenAI-style error body with its status (``errors.error_json``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.responses import Response, StreamingResponse

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
    return StreamingResponse(sse(result.chunks, on_end), media_type="text/event-stream",
                             headers=result.headers)


async def sse(chunks: AsyncIterator[bytes | ProxyError], on_end: Callable[[], None] | None
              ) -> AsyncIterator[bytes]:
    try:
        async for item in chunks:
            yield error_sse(item) if isinstance(item, ProxyError) else item
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
        if on_end is not None:
            on_end()
