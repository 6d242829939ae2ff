"""The hot path's way in: ``POST`` on the two completion paths, served ahead of Starlette's
middleware and router.

Those layers (the error middleware, the exception middleware, the router's match) wrap every
request and every message a stream sends; on the completion routes they cost about 0.03 ms a
request at c=1 (``benchmarks/proxy_ab.py``). :func:`hot_route` does for such a route what the
error middleware would: whatever it raises becomes the error handler's response.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)


class HotPaths(Starlette):
    """Starlette, with ``POST`` on the paths of ``hot`` (path: ASGI app) served before its
    middleware stack; every other request, and any other method on those paths, goes through
    the whole stack (lifespan, 404/405, the other routes). Middleware added to the app does
    not run on the hot paths; under a ``root_path`` they are served through the stack."""

    def __init__(self, hot: dict[str, ASGIApp], **kwargs: Any):
        self._hot = hot
        super().__init__(**kwargs)

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        hot = self._hot

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["method"] == "POST":
                route = hot.get(scope["path"])
                if route is not None:
                    return await route(scope, receive, send)
            await stack(scope, receive, send)

        return app


def hot_route(handler: Callable[[Request], Awaitable[Response]],
              on_error: Callable[[Request, Exception], Awaitable[Response]]) -> ASGIApp:
    """``handler`` as an ASGI app, with what Starlette's error middleware would do for it:
    whatever it raises becomes ``on_error``'s response (an error while streaming, after the
    headers, ends the connection, as it would there)."""
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:
            response = await on_error(request, exc)
        try:
            await response(scope, receive, send)
        except Exception:
            log.exception("unhandled error while answering %s %s", scope["method"],
                          scope["path"])
            raise
    return app

