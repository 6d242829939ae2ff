"""The FastAPI app: thin routes that parse, hand to the orchestrator, and render its result.

Rendering lives in one place (:func:`_render`): a Reply becomes JSON, a Stream becomes SSE
(``text/event-stream``, bytes exactly as the decode engine framed them), a ProxyError becomes an
OpenAI-style error body with its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any

import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.admission import Admission
from proxy.client_io import ClientGone, read_body, serve_unless_disconnected
from proxy.config import ProxyConfig
from proxy.costs import RouteCosts
from proxy.directory import Directory, Scaler
from proxy.engine_client import EngineClient, new_session
from proxy.errors import (
    InvalidRequest,
    MethodNotAllowed,
    NoEngineAvailable,
    ProxyError,
    RouteNotFound,
    Unauthorized,
    UpstreamError,
    error_json,
)
from proxy.kv_event_feed import run_feed
from proxy.loop_lag import watch_loop_lag
from proxy.metrics import ProxyMetrics
from proxy.orchestrator import Orchestrator, Reply, Stream
from proxy.policy import parse_policy
from proxy.pool import BOTH, Engine, EnginePool
from proxy.requests import (
    ApiRequest,
    Endpoint,
    check_content_type,
    check_request,
    parse_body,
    take_kv_limits,
)
from proxy.tokenizer_pool import TokenizerPool
from proxy.tokens import surely_over_context
from proxy.warmup import (
    probe_routes,
    reprobe_links,
    reprobe_sizes,
    warm_up_engine,
    warm_up_pairs,
)

log = logging.getLogger(__name__)


class ProxyState:
    """What the routes share: config, pool, orchestrator, metrics and background tasks."""

    def __init__(self, config: ProxyConfig, directory: Directory | None = None,
                 scaler: Scaler | None = None):
        self.config = config
        self.directory = directory
        self.prompts: TokenizerPool | None = None
        self.scaler = scaler
        self._feeds: dict[Engine, asyncio.Task] = {}
        self._scale_lock = asyncio.Lock()
        self.metrics = ProxyMetrics()
        self.warmed = not config.warmup
        self.session = None
        self.pool: EnginePool | None = None
        self.orchestrator: Orchestrator | None = None
        self._tasks: list[asyncio.Task] = []
        self._zmq: zmq.asyncio.Context | None = None
        self.admission = Admission(config.max_inflight, config.max_queued,
                                   config.queue_timeout_s)

    async def start(self) -> None:
        self.session = new_session()
        mk = lambda role, i, url: EngineClient(f"{role}-{i}", url, self.session)  # noqa: E731
        self.pool = EnginePool(
            [mk("prefill", i, u) for i, u in enumerate(self.config.prefill_urls)],
            [mk("decode", i, u) for i, u in enumerate(self.config.decode_urls)],
            self.metrics,
            prefill_events=self.config.prefill_kv_events,
            decode_events=self.config.decode_kv_events,
            both=[mk("engine", i, u) for i, u in enumerate(self.config.pool_urls)],
            both_events=self.config.pool_kv_events,
            both_duties=BOTH if self.config.layout == "pool" else frozenset({"decode"}),
        )
        # Loaded whenever configured (POST /pd/lookup uses it); requests are tokenized at the
        # proxy only under the policies that need prompt lengths and cache lookups.
        if self.config.tokenizer:
            self.prompts = await TokenizerPool.start(self.config.tokenizer,
                                                     self.config.tokenizer_workers,
                                                     self.config.tokenizer_inline_chars)
        prompts = self.prompts
        self._zmq = zmq.asyncio.Context()
        for engine in self.pool.all():
            self._start_feed(engine)
        self.costs = RouteCosts(self.config.kv_bytes_per_token or 1)
        self.orchestrator = Orchestrator(
            self.pool, parse_policy(self.config.policy), self.config.deadlines(), self.metrics,
            self.costs, prompts,
        )
        if self.directory is not None:
            await self.discover()
            self._tasks.append(asyncio.create_task(self._discovery_loop()))
        if self.config.loop_lag_probe_s > 0:
            self._tasks.append(asyncio.create_task(watch_loop_lag(
                self.metrics.event_loop_lag_seconds, self.config.loop_lag_probe_s)))
        await self.pool.probe_all()
        self._tasks.append(
            asyncio.create_task(self.pool.run_health_loop(self.config.health_interval_s))
        )
        if not self.warmed:
            self._tasks.append(asyncio.create_task(self._warm_up()))
        # Everything built so far lives as long as the proxy (the app, the tokenizer, torch's
        # modules under transformers: ~380k objects). Frozen, the garbage collector no longer
        # walks them: a full collection of them held the event loop 130-180 ms here.
        gc.freeze()

    def _start_feed(self, engine: Engine) -> None:
        if engine.events_endpoint and self._zmq is not None:
            self._feeds[engine] = asyncio.create_task(
                run_feed(engine.events_endpoint, engine.index, self._zmq))

    async def discover(self) -> None:
        """Reconcile the pool with the directory: new engines get a KV-event feed and a health
        probe at once; gone or restarted ones lose theirs."""
        assert self.directory is not None and self.pool is not None
        infos = await self.directory.endpoints()
        added, removed = self.pool.reconcile(
            infos, lambda name, url: EngineClient(name, url, self.session))
        for engine in removed:
            if (task := self._feeds.pop(engine, None)) is not None:
                task.cancel()
        for engine in added:
            self._start_feed(engine)
        if added:
            await asyncio.gather(*(self.pool.probe(e) for e in added))

    async def _discovery_loop(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.discover()
            except Exception:  # a directory hiccup must not stop discovery
                log.exception("engine discovery failed; keeping the current pool")

    async def scale(self, role: str, replicas: int, drain_timeout_s: float) -> dict:
        """Grow or shrink ``role`` to ``replicas`` engines; shrinking drains first (nothing in
        flight is dropped), newest engines go first."""
        assert self.scaler is not None and self.pool is not None
        async with self._scale_lock:
            names = await self.scaler.replicas(role)  # type: ignore[arg-type]
            added: list[str] = []
            removed: list[str] = []
            drained = True
            if replicas > len(names):
                added = await self.scaler.add(role, replicas - len(names))  # type: ignore[arg-type]
            elif replicas < len(names):
                removed = names[replicas:]
                self.pool.drain(removed)
                drained = await self.pool.wait_idle(removed, drain_timeout_s)
                await self.scaler.remove(removed)
            await self.discover()
            return {"role": role, "replicas": replicas, "added": added, "removed": removed,
                    "drained": drained}

    async def _warm_up(self) -> None:
        """Handshake every pair, seed the cost model, report ready, then keep links measured."""
        assert self.orchestrator is not None
        model = self.config.served_model_names[0]
        try:
            await warm_up_pairs(self.pool, model)
            await probe_routes(self.orchestrator, model, self.config.probe_tokens)
        finally:
            self.warmed = True  # failures are logged; requests are served either way
            # From now on an engine that joins or comes back pays its handshakes before users
            # do (a restarted engine has a new NIXL agent: every pair handshakes again).
            self.pool.on_up = lambda engine: self._spawn(warm_up_engine(self.pool, engine, model))
        if self.config.reprobe_s > 0 and self.config.probe_tokens:
            await reprobe_links(self.orchestrator, model,
                                reprobe_sizes(self.config.probe_tokens), self.config.reprobe_s)

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` in the background until it ends or the proxy stops."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._feeds.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()
        if self.prompts is not None:
            await self.prompts.close()
        if self._zmq is not None:
            self._zmq.term()

    @property
    def ready(self) -> bool:
        return self.pool is not None and self.pool.ready and self.warmed


async def _released_after(chunks: AsyncIterator[bytes], state: ProxyState
                          ) -> AsyncIterator[bytes]:
    """Relay ``chunks``; give the admission slot back when the stream ends, however it ends."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        await _aclose(chunks)
        state.admission.release()
        state.metrics.inflight_requests.dec()


async def _aclose(chunks: AsyncIterator[bytes]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


def _error_response(err: ProxyError, request_id: str | None = None) -> Response:
    headers = err.headers()
    if request_id:
        headers["x-request-id"] = request_id
    return Response(error_json(err), status_code=err.status, media_type="application/json",
                    headers=headers)


def _render(result: Reply | Stream) -> Response:
    if isinstance(result, Reply):
        return Response(result.body, status_code=result.status, media_type="application/json",
                        headers=result.headers)
    return StreamingResponse(result.chunks, media_type="text/event-stream", headers=result.headers)


class _ProxyApp(FastAPI):
    """FastAPI, except that a POST to one of ``fast_routes`` goes straight to its endpoint.

    Those endpoints take the raw Request, catch every exception themselves and return a
    Response, so FastAPI's middleware, routing and exception layers add nothing to them but
    time on every request's critical path."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fast_routes: dict[str, Callable[[Request], Awaitable[Response]]] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast_routes.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                response = await endpoint(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(config: ProxyConfig, directory: Directory | None = None,
               scaler: Scaler | None = None) -> FastAPI:
    """The proxy app. ``directory`` adds engines found at run time to the configured ones
    (Ray mode); ``scaler`` enables ``POST /pd/admin/scale``."""
    state = ProxyState(config, directory, scaler)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = _ProxyApp(title="pdserve proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
                    openapi_url=None)
    app.state.pd = state

    @app.exception_handler(StarletteHTTPException)
    async def route_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Routing's only errors, unknown paths (404) and wrong methods (405, with Allow),
        answer like every other error."""
        where = f"{request.method} {request.url.path}"
        err = (MethodNotAllowed(f"method not allowed: {where}") if exc.status_code == 405
               else RouteNotFound(f"no such route: {where}"))
        response = _error_response(err)
        response.headers.update(exc.headers or {})
        return response
    served = set(config.served_model_names)

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {config.api_key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise Unauthorized("invalid or missing API key")

    def check_ops_auth(request: Request) -> Response | None:
        """/health, /metrics, /pd/costs: public unless configured otherwise."""
        if config.public_health:
            return None
        try:
            check_auth(request)
        except ProxyError as err:
            return _error_response(err)
        return None

    def check_prompt_fits(body: dict[str, Any]) -> None:
        """A prompt surely longer than the context is refused before anyone tokenizes it (its
        characters against the longest token); one that may fit is the engine's to judge."""
        if config.max_model_len is None or state.prompts is None:
            return
        at_least = surely_over_context(body, config.max_model_len, state.prompts.info)
        if at_least is not None:
            raise InvalidRequest(
                f"This model's maximum context length is {config.max_model_len} tokens. "
                f"However, your request has at least {at_least} input tokens. Please reduce "
                "the length of the input messages.",
                param="messages" if "messages" in body else "prompt")

    async def completion(request: Request, endpoint: Endpoint) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            check_auth(request)
            check_content_type(request.headers.get("content-type"))
            raw = await read_body(request, config.body_limit_bytes, config.body_read_deadline_s)
            body = parse_body(raw, config.body_limit_bytes)
            stream = check_request(endpoint, body, served)
            check_prompt_fits(body)
            kv_limits = take_kv_limits(body)
            await state.admission.acquire()
        except ProxyError as err:
            state.metrics.rejected_total.labels(err.type).inc()
            return _error_response(err, request_id)
        except ClientGone:  # left while sending the body
            state.metrics.client_disconnects_total.labels("before_response").inc()
            return Response(status_code=499)
        assert state.orchestrator is not None
        api_request = ApiRequest(endpoint, body, stream, request_id, kv_limits=kv_limits)
        state.metrics.inflight_requests.inc()
        handed_off = False
        try:
            result = await serve_unless_disconnected(request, state.orchestrator.serve(api_request))
            if isinstance(result, Stream):
                result = replace(result, chunks=_released_after(result.chunks, state))
                handed_off = True
        except ClientGone:  # the orchestrator counted it, by stage
            return Response(status_code=499)
        except ProxyError as err:
            state.metrics.requests_total.labels(endpoint, "none", str(err.status)).inc()
            return _error_response(err, request_id)
        except Exception:  # never a stack trace to the client
            log.exception("request %s failed", request_id)
            err = UpstreamError("internal error while serving the request")
            state.metrics.requests_total.labels(endpoint, "none", str(err.status)).inc()
            return _error_response(err, request_id)
        finally:
            if not handed_off:
                state.admission.release()
                state.metrics.inflight_requests.dec()
        state.metrics.requests_total.labels(endpoint, result.route, "200").inc()
        return _render(result)

    async def chat_completions(request: Request) -> Response:
        return await completion(request, "chat")

    async def completions(request: Request) -> Response:
        return await completion(request, "completions")

    # The hot paths: served before FastAPI's middleware and routing (see _ProxyApp); the
    # routes stay registered for everything else (a GET on them answers 405).
    for path, endpoint in (("/v1/chat/completions", chat_completions),
                           ("/v1/completions", completions)):
        app.add_route(path, endpoint, methods=["POST"])
        app.fast_routes[path] = endpoint

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            check_auth(request)
        except ProxyError as err:
            return _error_response(err)
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "pdserve"}
            for name in config.served_model_names
        ]
        return Response(_dumps({"object": "list", "data": data}), media_type="application/json")

    @app.get("/health")
    async def health(request: Request) -> Response:
        if (denied := check_ops_auth(request)) is not None:
            return denied
        if state.ready:
            return Response(_dumps({"status": "ok"}), media_type="application/json")
        return _error_response(NoEngineAvailable("not ready: engines starting or down"))

    @app.get("/pd/costs")
    async def costs(request: Request) -> Response:
        """The live cost model (fits, queued work): what the next decisions will use."""
        if (denied := check_ops_auth(request)) is not None:
            return denied
        view = state.costs.describe()
        view["engines"] = {
            e.name: {"role": e.role, "url": e.client.base_url, "instance": e.instance,
                     "healthy": e.healthy, "warming": e.warming,
                     "draining": e.draining, "inflight": e.inflight,
                     "load_tokens": state.costs.load_tokens(e.name, e.foreign_requests,
                                                            e.mean_prompt_tokens),
                     "engine_requests": e.engine_requests,
                     "mean_prompt_tokens": e.mean_prompt_tokens,
                     "nixl_bytes_per_s": e.nixl_bytes_per_s, "nixl_transfers": e.nixl_transfers,
                     "cached_blocks": len(e.index), "block_size": e.index.block_size}
            for e in (state.pool.all() if state.pool else [])
        }
        return Response(_dumps(view), media_type="application/json")

    @app.post("/pd/lookup")
    async def lookup(request: Request) -> Response:
        """How many leading tokens of a prompt (a chat or completions body) each engine holds,
        by tier, according to the proxy's index: what the next decision for it would use."""
        try:
            check_auth(request)
            body = parse_body(await request.body(), config.body_limit_bytes)
        except ProxyError as err:
            return _error_response(err)
        all_engines = state.pool.all() if state.pool else []
        measured = None
        if state.prompts is not None:
            sizes = {e.index.block_size for e in all_engines if e.index.block_size}
            measured = await state.prompts.measure(body, sorted(sizes))
        if measured is None:
            return _error_response(InvalidRequest("cannot tokenize this body at the proxy"))
        engines = {}
        for e in all_engines:
            keys = measured.keys(e.index.block_size)
            tiers = {t: e.index.cached_keys(keys, tier=t) for t in e.index.tiers()}
            engines[e.name] = {"cached_tokens": e.index.cached_keys(keys), "by_tier": tiers}
        return Response(_dumps({"prompt_tokens": measured.n_tokens, "engines": engines}),
                        media_type="application/json")

    def routing_view() -> dict[str, Any]:
        assert state.orchestrator is not None and state.pool is not None
        return {"policy": str(state.orchestrator.policy),
                "engines": {e.name: {"role": e.role, "duties": sorted(e.duties)}
                            for e in state.pool.all()}}

    @app.get("/pd/admin/routing")
    async def get_routing(request: Request) -> Response:
        """The routing policy and what each engine is asked to do."""
        try:
            check_auth(request)
        except ProxyError as err:
            return _error_response(err)
        return Response(_dumps(routing_view()), media_type="application/json")

    @app.post("/pd/admin/routing")
    async def set_routing(request: Request) -> Response:
        """``{"policy": "auto"|..., "prefill": [names], "decode": [names]}`` (each optional):
        switch the policy, and the duties of the pool (``kv_both``) engines, at run time; what
        is in flight finishes as it started. Always requires the API key when one is set."""
        try:
            check_auth(request)
            body = parse_body(await request.body(), config.body_limit_bytes)
            assert state.orchestrator is not None and state.pool is not None
            policy = body.get("policy")
            if policy is not None:
                try:
                    mode = parse_policy(policy) if isinstance(policy, str) else None
                except ValueError as exc:
                    raise InvalidRequest(str(exc), param="policy") from None
                if mode is None:
                    raise InvalidRequest("'policy' must be a string", param="policy")
                if mode.kind == "auto" and config.kv_bytes_per_token is None:
                    raise InvalidRequest("policy 'auto' needs the model's KV size",
                                         param="policy")
            duties = {k: body.get(k) for k in ("prefill", "decode")}
            for key, names in duties.items():
                if names is not None and not (isinstance(names, list)
                                              and all(isinstance(n, str) for n in names)):
                    raise InvalidRequest(f"'{key}' must be a list of engine names", param=key)
            if any(v is not None for v in duties.values()):
                current = {d: [e.name for e in getattr(state.pool, d)] for d in duties}
                try:
                    state.pool.assign(duties["prefill"] if duties["prefill"] is not None
                                      else current["prefill"],
                                      duties["decode"] if duties["decode"] is not None
                                      else current["decode"])
                except ValueError as exc:
                    raise InvalidRequest(str(exc)) from None
            if policy is not None:
                state.orchestrator.policy = mode
        except ProxyError as err:
            return _error_response(err)
        log.info("routing now %s", routing_view())
        return Response(_dumps(routing_view()), media_type="application/json")

    @app.post("/pd/admin/scale")
    async def scale(request: Request) -> Response:
        """``{"role": "prefill"|"decode", "replicas": N}``: add engines, or drain and remove
        the newest ones. Always requires the API key when one is set."""
        try:
            check_auth(request)
            if state.scaler is None:
                raise InvalidRequest("this deployment cannot scale (dev mode); use pdserve ray")
            body = parse_body(await request.body(), config.body_limit_bytes)
            role, replicas = body.get("role"), body.get("replicas")
            if role not in ("prefill", "decode"):
                raise InvalidRequest("'role' must be 'prefill' or 'decode'", param="role")
            if not isinstance(replicas, int) or isinstance(replicas, bool) or not (
                    (1 if role == "decode" else 0) <= replicas <= 64):
                raise InvalidRequest("'replicas' must be an integer from "
                                     f"{1 if role == 'decode' else 0} to 64", param="replicas")
        except ProxyError as err:
            return _error_response(err)
        result = await state.scale(role, replicas, config.total_deadline_s)
        return Response(_dumps(result), media_type="application/json")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if (denied := check_ops_auth(request)) is not None:
            return denied
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _dumps(obj: object) -> bytes:
    import json

    return json.dumps(obj).encode()
