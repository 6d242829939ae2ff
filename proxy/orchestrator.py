"""One request's journey: choose engines and route, prefill, hand off, decode, relay.

``Orchestrator.serve`` returns a :class:`Reply` (whole body) or a :class:`Stream` (an async
iterator of SSE bytes exactly as the decode engine framed them), or raises a ``ProxyError``
before anything was sent. Once a stream has started, failures end it with an in-band error event
and ``[DONE]``; the decode request is closed (aborted) in a ``finally`` whatever happens.

Every request records what it measured (prefill time, hand-over, time to first token) into the
live cost state that the next decisions use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.costs import RouteCosts
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
from proxy.policy import Decision, PolicyMode, RouteInputs, decide
from proxy.pool import Engine, EnginePool
from proxy.requests import ApiRequest
from proxy.tokenizer_pool import TokenizerPool
from proxy.tokens import prompt_chars
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


@dataclass
class _Trace:
    """What one request measured on its way; fed to metrics and the cost state."""

    decision: Decision
    prefill: Engine | None
    decode: Engine
    prompt_chars: int
    prompt_tokens_est: int
    t_start: float
    route: str = "local"
    handoff: kv_params.PrefillHandoff | None = None
    t_handoff: float = 0.0
    #: Unix time after which the hand-off must not be read (the prefill's lease may be over).
    read_by: float = 0.0
    t_decode_sent: float = 0.0
    #: The decode engine sent its response headers (it has the request).
    decode_answered: bool = False
    decode_was_idle: bool = False
    queued_tokens: int = 0
    decode_cached_tokens: int = 0
    #: Output tokens the request may still generate, as counted in the decode engine's load.
    output_left: int = 0
    #: Bookkeeping (fits, histograms) deferred until the client has its first bytes: none of
    #: it changes this request's route, so none of it belongs on its critical path.
    deferred: list[Callable[[], None]] = field(default_factory=list)

    def run_deferred(self) -> None:
        work, self.deferred = self.deferred, []
        for fn in work:
            fn()

    @property
    def decode_new_tokens(self) -> int:
        """Prompt tokens the decode engine must load or compute (not in its own cache)."""
        return max(0, self.prompt_tokens_est - self.decode_cached_tokens)


#: Output budget assumed for a request that sets no max_tokens (routing load only).
DEFAULT_OUTPUT_BUDGET = 256


def output_budget(body: dict[str, Any]) -> int:
    """The most tokens the request may generate (its max_tokens), for the decode load."""
    for key in ("max_completion_tokens", "max_tokens"):
        if isinstance(body.get(key), int):
            return body[key]
    return DEFAULT_OUTPUT_BUDGET


def prefill_body(body: dict[str, Any], limits: kv_params.KVLimits | None = None
                 ) -> dict[str, Any]:
    """The client's request cut down to a prefill: one token, no stream, ids returned."""
    out = dict(body)
    out["max_tokens"] = 1
    out.pop("max_completion_tokens", None)
    out["stream"] = False
    out.pop("stream_options", None)
    out["return_token_ids"] = True
    out[kv_params.BODY_KEY] = kv_params.with_limits(kv_params.prefill_request_params(), limits)
    return out


def estimate_header(decision: Decision) -> str | None:
    if decision.predicted_disaggregated_s is None or decision.predicted_local_s is None:
        return None
    return (f"disaggregated={decision.predicted_disaggregated_s * 1e3:.1f}ms; "
            f"local={decision.predicted_local_s * 1e3:.1f}ms")


class Orchestrator:
    def __init__(
        self,
        pool: EnginePool,
        policy: PolicyMode,
        deadlines: Deadlines,
        metrics: ProxyMetrics,
        costs: RouteCosts,
        prompts: TokenizerPool | None = None,
    ):
        self.pool = pool
        self.policy = policy
        self.deadlines = deadlines
        self.metrics = metrics
        self.costs = costs
        #: Measures prompts off the event loop (length, block keys); None: estimate from chars.
        self.prompts = prompts
        self._background: set[asyncio.Task] = set()

    async def serve(
        self, req: ApiRequest, prefill: Engine | None = None, decode: Engine | None = None
    ) -> Reply | Stream:
        """Serve ``req``; ``prefill``/``decode`` pin the engines (probes), else the cheapest."""
        trace = await self._plan(req, prefill, decode)
        try:
            return await self._serve(req, trace)
        except BaseException:
            self._release_output(trace)
            trace.run_deferred()  # what the prefill measured holds even if decode failed
            raise

    async def _serve(self, req: ApiRequest, trace: _Trace) -> Reply | Stream:
        if trace.decision.route == "disaggregated" and trace.prefill is not None:
            try:
                trace.handoff = await self._prefill_or_fallback(trace, req)
            except asyncio.CancelledError:  # the client left; closing the request aborted it
                self.metrics.client_disconnects_total.labels("before_response").inc()
                raise
        trace.route = "disaggregated" if trace.handoff is not None else "local"
        trace.t_handoff = time.perf_counter()
        # The prefill engine frees the blocks when its lease ends; they may then be reused.
        trace.read_by = time.time() + self.deadlines.handoff_s
        body = self._decode_body(req, trace)
        if trace.handoff is not None:
            trace.deferred.append(lambda: self.metrics.stage_seconds.labels(
                "prefill", trace.route).observe(trace.t_handoff - trace.t_start))
        else:
            self._begin_local_work(trace)
        try:
            if not req.stream:
                data = await self._decode_whole(trace, req, body)
                return Reply(trace.route, 200, data, self._headers(req, trace))
            stream = await self._open_decode(trace, req, body)
        except asyncio.CancelledError:
            self._end_decode_work(trace)
            stage = "before_response"
            if trace.handoff is not None and not trace.decode_answered:
                # The client left after prefill, before decode answered: the decode request, if
                # it got out, is aborted, maybe before its engine took it. Prefill then holds
                # the blocks until its lease expires unless a decode reads them: read them now
                # (one token).
                stage = "after_prefill"
                self._release_blocks(trace, req, body)
            self.metrics.client_disconnects_total.labels(stage).inc()
            raise
        except BaseException:
            self._end_decode_work(trace)
            raise
        return Stream(trace.route, self._relay(stream, trace), self._headers(req, trace))

    def _decode_body(self, req: ApiRequest, trace: _Trace) -> dict[str, Any]:
        """The client's request for the decode engine: with the hand-off (pull the KV, if the
        engine gets to it by ``trace.read_by``) or without (compute the prompt), plus the
        client's KV limits either way."""
        body = dict(req.body)
        params = (kv_params.decode_request_params(trace.handoff, read_by=trace.read_by,
                                                  raw_ids=True)
                  if trace.handoff is not None else None)
        if (params := kv_params.with_limits(params, req.kv_limits)) is not None:
            body[kv_params.BODY_KEY] = params
        return body

    def _begin_local_work(self, trace: _Trace) -> None:
        """The decode engine computes the prompt: that is queued prompt work on it."""
        trace.queued_tokens = trace.decode_new_tokens
        trace.decode_was_idle = self.costs.begin(trace.decode.name, trace.queued_tokens)

    @staticmethod
    def _headers(req: ApiRequest, trace: _Trace) -> dict[str, str]:
        headers = {"x-request-id": req.request_id, "x-pd-route": trace.route}
        if (estimate := estimate_header(trace.decision)) is not None:
            headers["x-pd-estimate"] = estimate
        return headers

    # -- planning ------------------------------------------------------------------------------
    async def _plan(self, req: ApiRequest, prefill: Engine | None, decode: Engine | None
                    ) -> _Trace:
        t_start = time.perf_counter()
        chars = prompt_chars(req.body)
        measured = None
        if self.prompts is not None:
            sizes = {e.index.block_size for e in self.pool.all() if e.index.block_size}
            measured = await self.prompts.measure(req.body, sorted(sizes))
        tokens = measured.n_tokens if measured else self.costs.token_ratio.tokens(chars)
        budget = output_budget(req.body)

        hits: dict[str, int] = {}

        def cached(engine: Engine) -> int:  # once per engine: picking and deciding both ask
            if engine.name not in hits:
                hits[engine.name] = (engine.index.cached_keys(
                    measured.keys(engine.index.block_size)) if measured else 0)
            return hits[engine.name]

        # Least outstanding work after this request: its new prompt tokens (those the engine
        # has not cached) count on both sides; its output budget on the decode side.
        decode = decode or self.pool.pick_decode(
            lambda e: self._load(e) + tokens - cached(e) + budget)
        if decode is None:
            raise NoEngineAvailable("no decode engine is available")
        prefill = prefill or self.pool.pick_prefill(
            lambda e: self._load(e) + tokens - cached(e), exclude=decode)
        prefill_cached = cached(prefill) if prefill else 0
        decode_cached = cached(decode)
        costs = self.costs.inputs(
            prefill.name if prefill else None, decode.name,
            prefill.foreign_requests if prefill else 0, decode.foreign_requests,
            prefill.mean_prompt_tokens if prefill else None,
        )
        decision = decide(
            self.policy,
            RouteInputs(prompt_tokens=tokens, prefill_cached_tokens=prefill_cached,
                        decode_cached_tokens=decode_cached,
                        prefill_available=prefill is not None, costs=costs),
        )
        if req.force_route is not None and (req.force_route == "local" or prefill is not None):
            decision = replace(decision, route=req.force_route, reason="forced")
        self.metrics.decisions_total.labels(decision.route, decision.reason).inc()
        trace = _Trace(decision, prefill, decode, chars, tokens, t_start,
                       decode_cached_tokens=decode_cached)
        self._reserve_output(trace, budget)
        return trace

    def _load(self, engine: Engine) -> float:
        return self.costs.load_tokens(engine.name, engine.foreign_requests,
                                      engine.mean_prompt_tokens)

    def _reserve_output(self, trace: _Trace, budget: int) -> None:
        trace.output_left = budget
        self.costs.begin_output(trace.decode.name, budget)

    def _release_output(self, trace: _Trace, tokens: int | None = None) -> None:
        """Take ``tokens`` (all that is left when None) off the request's output budget."""
        n = trace.output_left if tokens is None else min(tokens, trace.output_left)
        if n > 0:
            trace.output_left -= n
            self.costs.end_output(trace.decode.name, n)

    # -- prefill leg ---------------------------------------------------------------------------
    async def _prefill_or_fallback(
        self, trace: _Trace, req: ApiRequest
    ) -> kv_params.PrefillHandoff | None:
        """Run the prefill leg; on an engine failure return None (serve local) and count why."""
        prefill = trace.prefill
        assert prefill is not None
        headers = {"x-request-id": req.request_id}
        idle = self.costs.begin(prefill.name, trace.prompt_tokens_est)
        t0 = time.perf_counter()
        try:
            with self.pool.using(prefill):
                reply = await prefill.client.post_json(
                    req.path, prefill_body(req.body, req.kv_limits), headers,
                    self.deadlines.prefill_s
                )
            if 400 <= reply.status < 500:
                raise from_engine_error(reply.status, reply.body)
            if reply.status != 200:
                return self._fallback("prefill_error")
            handoff = kv_params.parse_prefill_json(reply.body)
        except ClientError:
            raise
        except EngineUnreachable:
            self.pool.mark_down(prefill)
            return self._fallback("prefill_unreachable")
        except EngineTimeout:
            return self._fallback("prefill_timeout")
        except (kv_params.HandoffError, ValueError):
            return self._fallback("bad_handoff")
        finally:
            self.costs.end(prefill.name, trace.prompt_tokens_est)
        n = handoff.num_prompt_tokens
        self.costs.observe_prompt(trace.prompt_chars, n)
        if idle:
            new, seconds = n - handoff.cached_tokens, time.perf_counter() - t0
            trace.deferred.append(
                lambda: self.costs.observe_remote_prefill(prefill.name, new, seconds))
        return handoff

    def _fallback(self, reason: str) -> None:
        log.warning("prefill failed (%s): serving locally", reason)
        self.metrics.fallbacks_total.labels(reason).inc()
        return None

    def _release_blocks(self, trace: _Trace, req: ApiRequest, body: dict[str, Any]) -> None:
        release = dict(body, max_tokens=1, stream=False)
        release.pop("max_completion_tokens", None)
        release.pop("stream_options", None)
        client = trace.decode.client

        async def run() -> None:
            try:
                await client.post_json(req.path, release, {"x-request-id": req.request_id},
                                       self.deadlines.first_byte_s)
            except Exception as exc:  # noqa: BLE001 - best effort; the lease frees them later
                log.warning("could not release prefill blocks of %s: %s", req.request_id, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- decode leg ----------------------------------------------------------------------------
    async def _open_decode(self, trace: _Trace, req: ApiRequest, body: dict[str, Any]
                           ) -> EngineStream:
        """Send the decode request. A decode engine that cannot be reached has seen nothing of
        the request, so it goes to another healthy decode engine (once each) before failing;
        any decode engine can pull the prefill's KV."""
        tried: set[str] = set()
        while True:
            decode = trace.decode
            tried.add(decode.name)
            trace.t_decode_sent = time.perf_counter()
            try:
                with self.pool.using(decode):
                    stream = await decode.client.open_stream(
                        req.path, body, {"x-request-id": req.request_id},
                        self.deadlines.first_byte_s, self.deadlines.idle_s,
                    )
                break
            except EngineUnreachable as exc:
                self.pool.mark_down(decode)
                other = self.pool.pick_decode(self._load)
                if other is None or other.name in tried:
                    raise UpstreamError("the decode engine is unreachable") from None
                log.warning("decode %s unreachable: retrying %s on %s", decode.name,
                            req.request_id, other.name)
                self.metrics.fallbacks_total.labels("decode_retried").inc()
                self._switch_decode(trace, other)
                if trace.handoff is not None and (exc.delivered or time.time() > trace.read_by):
                    body = self._recompute_instead(trace, req, exc.delivered)
            except EngineTimeout:
                raise StageTimeout("the decode engine did not answer in time") from None
        trace.decode_answered = True
        if stream.status != 200:
            try:
                data = await stream.read_all()
            finally:
                stream.close()
            raise from_engine_error(stream.status, data)
        return stream

    def _recompute_instead(self, trace: _Trace, req: ApiRequest, delivered: bool
                           ) -> dict[str, Any]:
        """Drop the hand-off: the next decode engine computes the prompt itself. Used when the
        engine that failed may have read the KV already (its read frees the prefill's blocks,
        which may then hold another request's KV), or when the prefill's lease on them is
        nearly over: a late read of blocks reused meanwhile would be silent garbage."""
        reason = "handoff_maybe_read" if delivered else "handoff_expired"
        log.warning("%s: the retry computes the prompt (%s)", req.request_id, reason)
        self.metrics.fallbacks_total.labels(reason).inc()
        trace.handoff = None
        trace.route = "local"
        self._begin_local_work(trace)
        return self._decode_body(req, trace)

    def _switch_decode(self, trace: _Trace, other: Engine) -> None:
        """Move the request's decode (and its queued local prompt work) to ``other``."""
        local_work, output_left = trace.queued_tokens, trace.output_left
        self._end_decode_work(trace)
        self._release_output(trace)
        trace.decode = other
        self._reserve_output(trace, output_left)
        if local_work:
            trace.queued_tokens = local_work
            trace.decode_was_idle = self.costs.begin(other.name, local_work)

    async def _decode_whole(self, trace: _Trace, req: ApiRequest, body: dict[str, Any]) -> bytes:
        stream = await self._open_decode(trace, req, body)
        with self.pool.using(trace.decode):
            try:
                async with asyncio.timeout(self.deadlines.total_s):
                    data = await stream.read_all()
            except TimeoutError:
                raise StageTimeout("the decode engine did not finish in time") from None
            except Exception:
                raise UpstreamError("the decode engine failed while answering") from None
            finally:
                stream.close()
                self._end_decode_work(trace)
                self._release_output(trace)
                trace.run_deferred()
        # A whole reply has no first-token time: only its total is recorded.
        self.metrics.stage_seconds.labels("total", trace.route).observe(
            time.perf_counter() - trace.t_start
        )
        return data

    def _end_decode_work(self, trace: _Trace) -> None:
        if trace.queued_tokens:
            self.costs.end(trace.decode.name, trace.queued_tokens)
            trace.queued_tokens = 0

    def _on_first_byte(self, trace: _Trace, now: float) -> None:
        """Record what the first bytes measured; runs once the client has them."""
        self._end_decode_work(trace)
        trace.run_deferred()
        ttft = now - trace.t_start
        self.metrics.stage_seconds.labels("ttft", trace.route).observe(ttft)
        predicted = trace.decision.predicted_s() if trace.route == trace.decision.route else None
        if predicted:
            self.metrics.ttft_prediction_ratio.labels(trace.route).observe(ttft / predicted)
        if trace.handoff is not None and trace.prefill is not None:
            handover = now - trace.t_handoff
            self.metrics.stage_seconds.labels("handover", trace.route).observe(handover)
            moved = trace.handoff.num_prompt_tokens - trace.decode_cached_tokens
            self.costs.observe_handover(trace.prefill.name, trace.decode.name, moved, handover)
        elif trace.decode_was_idle:
            self.costs.observe_local_prefill(trace.decode.name, trace.decode_new_tokens,
                                             now - trace.t_decode_sent)

    async def _relay(self, stream: EngineStream, trace: _Trace) -> AsyncIterator[bytes]:
        t_first = 0.0
        tail = b""
        decode = trace.decode
        decode.inflight += 1
        try:
            async with asyncio.timeout(self.deadlines.total_s):
                async for chunk in stream.chunks():
                    # Bytes first, bookkeeping after: the consumer writes ``chunk`` to the
                    # client before this generator resumes.
                    if not t_first:
                        t_first = time.perf_counter()
                        yield chunk
                        self._on_first_byte(trace, t_first)
                    else:
                        yield chunk
                    tail = (tail + chunk)[-32:]
                    self._release_output(trace, chunk.count(b"data: "))
            if _DONE not in tail:
                raise EngineUnreachable("decode stream ended without [DONE]")
        except (EngineUnreachable, EngineTimeout, TimeoutError) as exc:
            lost = isinstance(exc, EngineUnreachable)
            reason = "decode_lost" if lost else "decode_timeout"
            self.metrics.stream_errors_total.labels(reason).inc()
            if lost:
                self.pool.mark_down(decode)
            err: ProxyError = (
                UpstreamError("the decode engine failed mid-stream")
                if lost
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
            self._end_decode_work(trace)
            self._release_output(trace)
            trace.run_deferred()
            self.metrics.stage_seconds.labels("total", trace.route).observe(
                time.perf_counter() - trace.t_start
            )
