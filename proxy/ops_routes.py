"""The operators' routes: what the proxy knows (``/pd/costs``, ``/pd/decisions``,
``/pd/lookup``, ``/metrics``) and what it may be told (``/pd/admin/*``).

Each handler takes the request and the running :class:`ProxyService`; ``app.py`` wraps it in the
one auth check and turns a ``ProxyError`` into its error body.
"""

from __future__ import annotations

import json
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from proxy.admin import RoutingRequest, ScaleRequest, parse_admin
from proxy.client_io import read_body
from proxy.errors import InvalidRequest
from proxy.requests import check_request, parse_body
from proxy.service import ProxyService


def json_response(obj: object) -> Response:
    return Response(json.dumps(obj).encode(), media_type="application/json")


async def costs(request: Request, service: ProxyService) -> Response:
    """The live cost model (fits, queued work): what the next decisions will use."""
    view = service.costs.describe()
    view["engines"] = {
        e.name: {"role": e.role, "duties": sorted(e.duties), "url": e.client.base_url,
                 "instance": e.instance, "healthy": e.healthy, "warming": e.warming,
                 "stalls": e.stalls, "silent": e.silent,
                 "draining": e.draining, "inflight": e.inflight,
                 "load_tokens": service.costs.load_tokens(e.name, e.foreign_requests,
                                                          e.mean_prompt_tokens),
                 "engine_requests": e.engine_requests,
                 "mean_prompt_tokens": e.mean_prompt_tokens,
                 "nixl_bytes_per_s": e.nixl_bytes_per_s, "nixl_transfers": e.nixl_transfers,
                 "kv_pull_failures": e.kv_pull_failures,
                 "cached_blocks": len(e.index), "block_size": e.index.block_size}
        for e in service.pool.all()}
    view["pairs_routed_around"] = service.pool.pair_health.routed_around(time.monotonic())
    return json_response(view)


async def decisions(request: Request, service: ProxyService) -> Response:
    """The latest routing decisions, newest first (``proxy/decision_log.py``):
    ``?request_id=`` one request's (a migrated stream has one per engine), ``?prefix=`` those
    whose id starts so (a benchmark's run), ``?limit=`` at most that many (default 100)."""
    query = request.query_params
    raw = query.get("limit", "100")
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise InvalidRequest("'limit' must be a positive integer", param="limit")
    return json_response({"decisions": service.orchestrator.decisions.recent(
        int(raw), request_id=query.get("request_id"), prefix=query.get("prefix"))})


async def lookup(request: Request, service: ProxyService) -> Response:
    """How many leading tokens of a prompt (a chat or completions body) each engine holds,
    by tier, according to the proxy's index: what the next decision for it would use."""
    body = parse_body(await _body(request, service), service.config.body_limit_bytes)
    check_request("chat" if "messages" in body else "completions", body,
                  set(service.config.served_model_names))
    engines = service.pool.all()
    measured = None
    if service.prompts is not None:
        sizes = {e.index.block_size for e in engines if e.index.block_size}
        measured = await service.prompts.measure(body, sorted(sizes))
    if measured is None:
        raise InvalidRequest("cannot tokenize this body at the proxy")
    view = {}
    for e in engines:
        keys = measured.keys(e.index.block_size)
        view[e.name] = {"cached_tokens": e.index.cached_keys(keys),
                        "by_tier": {t: e.index.cached_keys(keys, tier=t)
                                    for t in e.index.tiers()}}
    return json_response({"prompt_tokens": measured.n_tokens, "engines": view})


async def scale(request: Request, service: ProxyService) -> Response:
    """``{"role": "prefill"|"decode", "replicas": N}``: add engines, or drain and remove the
    newest ones."""
    if service.scaler is None:
        raise InvalidRequest("this deployment cannot scale (dev mode); use pdserve ray")
    order: ScaleRequest = parse_admin(ScaleRequest, await _body(request, service))
    drain_s = order.drain_timeout_s or service.config.total_deadline_s
    return json_response(await service.scale(order.role, order.replicas, drain_s))


async def get_routing(request: Request, service: ProxyService) -> Response:
    """The routing policy and what each engine is asked to do."""
    return json_response(service.routing())


async def set_routing(request: Request, service: ProxyService) -> Response:
    """Switch the policy, and the engines' duties, at run time: a ``kv_both`` engine may take
    either duty, an engine of a fixed role left out of its duty's list is cordoned (given
    nothing new). What is in flight finishes as it started."""
    order: RoutingRequest = parse_admin(RoutingRequest, await _body(request, service))
    try:
        policy = order.policy_mode()
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="policy") from None
    if policy is not None and policy.kind == "auto" and service.config.kv_bytes_per_token is None:
        raise InvalidRequest("policy 'auto' needs the model's KV size", param="policy")
    try:
        return json_response(service.set_routing(policy, order.prefill, order.decode))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


async def _body(request: Request, service: ProxyService) -> bytes:
    """The body, within the size and time limits a request's has."""
    config = service.config
    return await read_body(request, config.body_limit_bytes, config.body_read_deadline_s)


async def metrics(request: Request, service: ProxyService) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
