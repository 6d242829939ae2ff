"""One request's journey: choose engines and route, prefill, hand off, decode, relay.

``Orchestrator.serve`` returns a :class:`Reply` (whole body) or a :class:`Stream` (an async
iterator of SSE bytes exactly as the decode engine framed them), or raises a ``ProxyError``
before anything was sent. Once a stream has started, failures end it with an in-band error event
and ``[DONE]``; the decode request is closed (aborted) in a ``finally`` whatever happens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from proxy.deadlines import Deadlines
from proxy.engine_client import EngineStream, EngineTimeout, EngineUnreachable
from proxy.errors import (
    ClientError,
    NoEngineAvailable,
    ProxyError,
    StageTimeout,
    UpstreamError,
    error_sse,
    from_engine_error,
)
from proxy.metrics import ProxyMetrics
from proxy.policy import PolicyMode, RouteInputs, decide
from proxy.pool import Engine, EnginePool
from proxy.requests import ApiRequest
from transport import kv_params

log = logging.getLogger(__name__)
_DONE = b"data: [DONE]"


@dataclass(frozen=True)
class Reply:
    route: str
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Stream:
    route: str
    chunks: AsyncIterator[bytes]
    headers: dict[str, str] = field(default_factory=dict)


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Rough prompt length before tokenization (chars / 4, as llm-d estimates it)."""
    if "messages" in body:
        chars = sum(len(str(m.get("content") or "")) for m in body["messages"])
    else:
        prompt = body.get("prompt")
        chars = len(prompt) if isinstance(prompt, str) else 4 * len(prompt or [])
    return chars // 4


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request cut down to a prefill: one token, no stream, ids returned."""
    out = dict(body)
    out["max_tokens"] = 1
    out.pop("max_completion_tokens", None)
    out["stream"] = False
    out.pop("stream_options", None)
    out["return_token_ids"] = True
    out[kv_params.BODY_KEY] = kv_params.prefill_request_params()
    return out


class Orchestrator:
    def __init__(
        self, pool: EnginePool, policy: PolicyMode, deadlines: Deadlines, metrics: ProxyMetrics
    ):
        self.pool = pool
        self.policy = policy
        self.deadlines = deadlines
        self.metrics = metrics

    async def serve(self, req: ApiRequest) -> Reply | Stream:
        t_start = time.perf_counter()
        decode = self.pool.pick_decode()
        if decode is None:
            raise NoEngineAvailable("no decode engine is available")
        prefill = self.pool.pick_prefill()
        decision = decide(
            self.policy,
            RouteInputs(
                prompt_tokens=estimate_prompt_tokens(req.body),
                prefill_available=prefill is not None,
            ),
        )
        self.metrics.decisions_total.labels(decision.route, decision.reason).inc()
        handoff = None
        if decision.route == "disaggregated" and prefill is not None:
            handoff = await self._prefill_or_fallback(prefill, req)
        route = "disaggregated" if handoff is not None else "local"
        t_handoff = time.perf_counter()
        if handoff is not None:
            self.metrics.stage_seconds.labels("prefill", route).observe(t_handoff - t_start)
        body = dict(req.body)
        if handoff is not None:
            body[kv_params.BODY_KEY] = kv_params.decode_request_params(handoff)
        headers = {"x-request-id": req.request_id}
        out_headers = {"x-request-id": req.request_id, "x-pd-route": route}
        if not req.stream:
            with self.pool.using(decode):
                stream = await self._open_decode(decode, req, body, headers)
                try:
                    data = await self._read_whole(stream)
                finally:
                    stream.close()
            self._observe_first_byte(route, t_start, t_handoff, handoff is not None)
            return Reply(route, 200, data, out_headers)
        with self.pool.using(decode):
            stream = await self._open_decode(decode, req, body, headers)
        return Stream(
            route, self._relay(stream, decode, route, t_start, t_handoff, handoff), out_headers
        )

    async def _prefill_or_fallback(self, prefill: Engine, req: ApiRequest):
        """Run the prefill leg; on an engine failure return None (serve local) and count why."""
        headers = {"x-request-id": req.request_id}
        try:
            with self.pool.using(prefill):
                reply = await prefill.client.post_json(
                    req.path, prefill_body(req.body), headers, self.deadlines.prefill_s
                )
            if 400 <= reply.status < 500:
                raise from_engine_error(reply.status, reply.body)
            if reply.status != 200:
                return self._fallback("prefill_error")
            return kv_params.parse_prefill_reply(reply.json())
        except ClientError:
            raise
        except EngineUnreachable:
            self.pool.mark_down(prefill)
            return self._fallback("prefill_unreachable")
        except EngineTimeout:
            return self._fallback("prefill_timeout")
        except (kv_params.HandoffError, ValueError):
            return self._fallback("bad_handoff")

    def _fallback(self, reason: str) -> None:
        log.warning("prefill failed (%s): serving locally", reason)
        self.metrics.fallbacks_total.labels(reason).inc()
        return None

    async def _open_decode(
        self, decode: Engine, req: ApiRequest, body: dict[str, Any], headers: dict[str, str]
    ) -> EngineStream:
        try:
            stream = await decode.client.open_stream(
                req.path, body, headers, self.deadlines.first_byte_s, self.deadlines.idle_s
            )
        except EngineUnreachable:
            self.pool.mark_down(decode)
            raise UpstreamError("the decode engine is unreachable") from None
        except EngineTimeout:
            raise StageTimeout("the decode engine did not answer in time") from None
        if stream.status != 200:
            try:
                data = await stream.read_all()
            finally:
                stream.close()
            raise from_engine_error(stream.status, data)
        return stream

    async def _read_whole(self, stream: EngineStream) -> bytes:
        try:
            async with asyncio.timeout(self.deadlines.total_s):
                return await stream.read_all()
        except TimeoutError:
            raise StageTimeout("the decode engine did not finish in time") from None
        except Exception:
            raise UpstreamError("the decode engine failed while answering") from None

    def _observe_first_byte(
        self, route: str, t_start: float, t_handoff: float, disaggregated: bool
    ) -> None:
        now = time.perf_counter()
        self.metrics.stage_seconds.labels("ttft", route).observe(now - t_start)
        if disaggregated:
            self.metrics.stage_seconds.labels("handover", route).observe(now - t_handoff)

    async def _relay(
        self,
        stream: EngineStream,
        decode: Engine,
        route: str,
        t_start: float,
        t_handoff: float,
        handoff: kv_params.PrefillHandoff | None,
    ) -> AsyncIterator[bytes]:
        first = True
        tail = b""
        decode.inflight += 1
        try:
            async with asyncio.timeout(self.deadlines.total_s):
                async for chunk in stream.chunks():
                    if first:
                        first = False
                        self._observe_first_byte(route, t_start, t_handoff, handoff is not None)
                    tail = (tail + chunk)[-32:]
                    yield chunk
            if _DONE not in tail:
                raise EngineUnreachable("decode stream ended without [DONE]")
        except (EngineUnreachable, EngineTimeout, TimeoutError) as exc:
            reason = "decode_timeout" if not isinstance(exc, EngineUnreachable) else "decode_lost"
            self.metrics.stream_errors_total.labels(reason).inc()
            if isinstance(exc, EngineUnreachable):
                self.pool.mark_down(decode)
            err: ProxyError = (
                UpstreamError("the decode engine failed mid-stream")
                if reason == "decode_lost"
                else StageTimeout("the decode engine stalled mid-stream")
            )
            yield error_sse(err)
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away: closing the decode stream (below) makes vLLM abort it.
            self.metrics.client_disconnects_total.labels("streaming").inc()
            raise
        finally:
            decode.inflight -= 1
            stream.close()
            self.metrics.stage_seconds.labels("total", route).observe(
                time.perf_counter() - t_start
            )

