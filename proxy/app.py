"""The HTTP API: thin Starlette routes that check, parse, hand to the service and render.

``create_app(config)`` returns the ASGI app; its lifespan starts the :class:`ProxyService`
(``app.state.pd``) and stops it. Each route: authenticate (one wrapper, :func:`_guarded`),
parse and validate (``requests.py``, ``admin.py``: 4xx before any engine is touched), call the
service, and render (``render.py``, the one place results become HTTP). The two completion
routes are the hot path: ``POST`` on them is served ahead of Starlette's middleware and router
(``hot_paths.py``), with the same answers. The operators' routes live in ``ops_routes.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy import ops_routes as ops
from proxy.client_io import ClientGone, read_body, serve_unless_disconnected
from proxy.config import ProxyConfig
from proxy.directory import Directory, Restarter, Scaler
from proxy.errors import (
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NoEngineAvailable,
    ProxyError,
    RouteNotFound,
    Unauthorized,
)
from proxy.hot_paths import HotPaths, hot_route
from proxy.ops_routes import json_response
from proxy.orchestrator import Stream
from proxy.render import error_response, render
from proxy.requests import (
    ApiRequest,
    Endpoint,
    check_content_type,
    check_request,
    parse_body,
    take_kv_limits,
    take_slo,
)
from proxy.service import ProxyService
from proxy.tokens import surely_over_context

log = logging.getLogger(__name__)
Handler = Callable[[Request, ProxyService], Awaitable[Response]]


def create_app(config: ProxyConfig, directory: Directory | None = None,
               scaler: Scaler | None = None, restarter: Restarter | None = None) -> Starlette:
    """The proxy app. ``directory`` adds engines found at run time to the configured ones
    (Ray mode); ``scaler`` enables ``POST /pd/admin/scale``; ``restarter`` restarts an
    engine whose core hung (``proxy/stalls.py``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.pd = await ProxyService.start(config, directory, scaler, restarter)
        try:
            yield
        finally:
            await app.state.pd.stop()

    expected = None if config.api_key is None else hashlib.sha256(
        config.api_key.encode()).digest()

    def check_key(request: Request) -> None:
        """``Authorization: Bearer <key>``, the scheme in any case (RFC 9110); compared as
        digests, in constant time and length."""
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        if not (hmac.compare_digest(given, expected) and scheme.lower() == "bearer"):
            raise Unauthorized("invalid or missing API key")

    def guarded(handler: Handler, ops: bool = False) -> Callable[[Request], Awaitable[Response]]:
        """The route: the API key checked (for ``ops`` routes only when ops are private), then
        ``handler`` with the service; a ProxyError it raises becomes its error body."""
        async def route(request: Request) -> Response:
            try:
                if not (ops and config.public_health):
                    check_key(request)
                return await handler(request, request.app.state.pd)
            except ProxyError as err:
                return error_response(err)
        return route

    served = set(config.served_model_names)

    async def completion(request: Request, endpoint: Endpoint) -> Response:
        t_arrival = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + config.total_deadline_s
        service: ProxyService = request.app.state.pd
        # 128 random bits as 32 hex digits (``uuid4().hex``'s form, a quarter of its cost)
        request_id = request.headers.get("x-request-id") or os.urandom(16).hex()
        try:
            check_key(request)
            check_content_type(request.headers.get("content-type"))
            raw = await read_body(request, config.body_limit_bytes, config.body_read_deadline_s)
            body = parse_body(raw, config.body_limit_bytes)
            stream = check_request(endpoint, body, served)
            check_prompt_fits(config, service, body)
            kv_limits = take_kv_limits(body)
            targets = take_slo(body)
            t_queued = time.perf_counter()
            await service.admission.acquire()
        except ProxyError as err:
            service.metrics.rejected_total.labels(err.type).inc()
            if service.tracing is not None:
                service.tracing.refused(request_id, endpoint, t_arrival, err.status, err.type)
            return error_response(err, request_id)
        except ClientGone:  # left while sending the body
            service.metrics.client_disconnects_total.labels("before_response").inc()
            return Response(status_code=499)
        spans = None
        if service.tracing is not None:
            spans = service.tracing.request(request_id, endpoint, t_arrival)
            spans.hold("admission", t_queued, time.perf_counter())
        api_request = ApiRequest(endpoint, body, stream, request_id, kv_limits=kv_limits,
                                 targets=targets, spans=spans, deadline=deadline)
        service.metrics.inflight_requests.inc()

        def done() -> None:
            service.admission.release()
            service.metrics.inflight_requests.dec()
            if spans is not None:
                spans.end()

        handed_off = False
        try:
            result = await serve_unless_disconnected(request,
                                                     service.orchestrator.serve(api_request))
            handed_off = isinstance(result, Stream)  # the stream's end releases the slot
        except ClientGone:  # the orchestrator counted it, by stage
            return Response(status_code=499)
        except ProxyError as err:
            service.metrics.requests_total.labels(endpoint, "none", str(err.status)).inc()
            if spans is not None:
                spans.failed(err.status, err.type)
            return error_response(err, request_id)
        except Exception:  # never a stack trace to the client
            log.exception("request %s failed", request_id)
            internal = InternalError("internal error while serving the request")
            service.metrics.requests_total.labels(endpoint, "none", str(internal.status)).inc()
            if spans is not None:
                spans.failed(internal.status, internal.type)
            return error_response(internal, request_id)
        finally:
            if not handed_off:
                done()
        service.metrics.requests_total.labels(endpoint, result.route, "200").inc()
        return render(result, on_end=done if handed_off else None)

    async def chat_completions(request: Request) -> Response:
        return await completion(request, "chat")

    async def completions(request: Request) -> Response:
        return await completion(request, "completions")

    async def models(request: Request, service: ProxyService) -> Response:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "pdserve"}
                for name in config.served_model_names]
        return json_response({"object": "list", "data": data})

    async def health(request: Request, service: ProxyService) -> Response:
        if service.ready:
            return json_response({"status": "ok"})
        return error_response(NoEngineAvailable("not ready: engines starting or down"))

    async def route_error(request: Request, exc: Exception) -> Response:
        """Routing's only errors, unknown paths (404) and wrong methods (405, with Allow),
        answer like every other error."""
        assert isinstance(exc, StarletteHTTPException)
        where = f"{request.method} {request.url.path}"
        err = (MethodNotAllowed(f"method not allowed: {where}") if exc.status_code == 405
               else RouteNotFound(f"no such route: {where}"))
        response = error_response(err)
        response.headers.update(exc.headers or {})
        return response

    routes = [
        # The completion routes: POST is served ahead of the router (hot_paths.py); other
        # methods meet it here (405).
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/health", guarded(health, ops=True), methods=["GET"]),
        Route("/metrics", guarded(ops.metrics, ops=True), methods=["GET"]),
        Route("/pd/costs", guarded(ops.costs, ops=True), methods=["GET"]),
        Route("/pd/decisions", guarded(ops.decisions, ops=True), methods=["GET"]),
        Route("/pd/lookup", guarded(ops.lookup), methods=["POST"]),
        Route("/pd/admin/scale", guarded(ops.scale), methods=["POST"]),
        Route("/pd/admin/routing", guarded(ops.get_routing), methods=["GET"]),
        Route("/pd/admin/routing", guarded(ops.set_routing), methods=["POST"]),
    ]
    async def internal_error(request: Request, exc: Exception) -> Response:
        """Whatever escaped a route: logged, and an OpenAI-style 500 (never a traceback or a
        plain-text body)."""
        log.error("unhandled error on %s %s", request.method, request.url.path,
                  exc_info=exc)
        return error_response(InternalError("internal error while serving the request"))

    hot = {"/v1/chat/completions": hot_route(chat_completions, internal_error),
           "/v1/completions": hot_route(completions, internal_error)}
    return HotPaths(hot, routes=routes, lifespan=lifespan,
                    exception_handlers={StarletteHTTPException: route_error,
                                        Exception: internal_error})


def check_prompt_fits(config: ProxyConfig, service: ProxyService, body: dict[str, Any]) -> None:
    """A prompt surely longer than the context is refused before anyone tokenizes it (its
    characters against the longest token); one that may fit is the engine's to judge."""
    if config.max_model_len is None or service.prompts is None:
        return
    at_least = surely_over_context(body, config.max_model_len, service.prompts.info)
    if at_least is not None:
        raise InvalidRequest(
            f"This model's maximum context length is {config.max_model_len} tokens. "
            f"However, your request has at least {at_least} input tokens. Please reduce "
            "the length of the input messages.",
            param="messages" if "messages" in body else "prompt")
