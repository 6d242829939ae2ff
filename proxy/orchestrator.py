"""One request's journey: measure the prompt, plan, prefill, hand off, decode, relay.

``Orchestrator.serve`` returns a :class:`Reply` (whole body) or a :class:`Stream` (an async
iterator of SSE bytes exactly as the decode engine framed them, and at most one ProxyError for
the renderer when the engine fails mid-stream), or raises a ``ProxyError`` before anything was
sent. The parts, each in its own module:

- ``plan.py`` — engines and route, from the measured prompt and the live costs (no I/O);
- ``prefill_leg.py`` — the prefill engine's leg, falling back to local on its failures;
- ``decode_leg.py`` — the decode request, its retry on another engine, a whole reply;
- ``relay.py`` — a stream to the client;
- ``migration.py``, ``transcript.py`` — a stream continued on another engine when its own is
  lost;
- ``engine_bodies.py`` — every body sent to an engine;
- ``ledger.py`` — what the request has outstanding on each engine, released once;
- ``trace.py`` — stage times and the bookkeeping deferred past the first bytes.

Every request records what it measured (prefill time, hand-over, time to first token) into the
live cost state that the next decisions use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field, replace

from proxy.costs import RouteCosts
from proxy.deadlines import Deadlines
from proxy.decision_log import DecisionLog
from proxy.decode_leg import DecodeLeg
from proxy.engine_bodies import output_budget, stated_output_budget
from proxy.errors import (
    DecodeLost,
    DecodeStalled,
    NoEngineAvailable,
    ProxyError,
    RequestDeadline,
    StageTimeout,
    UpstreamError,
)
from proxy.ledger import Ledger
from proxy.metrics import ProxyMetrics
from proxy.migration import migrating, not_migratable, with_token_ids
from proxy.plan import Plan, make_plan
from proxy.policy import PolicyMode, Targets
from proxy.pool import Engine, EnginePool
from proxy.prefill_leg import PrefillLeg
from proxy.relay import relay, whole_reply
from proxy.requests import ApiRequest
from proxy.tokenizer_pool import TokenizerPool
from proxy.tokens import prompt_chars
from proxy.trace import Trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reply:
    route: str
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Stream:
    route: str
    chunks: AsyncIterator[bytes | ProxyError]
    headers: dict[str, str]
    #: The decode engine the chunks come from (a migration excludes it).
    engine: str
    #: For a stream dropped before its first read (the client gone while the response headers
    #: were written): closing a generator that never started runs none of its cleanup, so this
    #: closes the decode request and releases its claim instead.
    abandon: Callable[[], None]
    #: The request's deadline (``loop.time()``): a client that stops taking the stream does
    #: not hold it past that.
    deadline: float | None = None


class Orchestrator:
    def __init__(
        self,
        pool: EnginePool,
        policy: PolicyMode,
        deadlines: Deadlines,
        metrics: ProxyMetrics,
        costs: RouteCosts,
        prompts: TokenizerPool | None = None,
        targets: Targets | None = None,
        migration_limit: int = 3,
        max_model_len: int | None = None,
    ):
        self.pool = pool
        #: The routing policy; switched at run time by ``POST /pd/admin/routing``.
        self.policy = policy
        self.deadlines = deadlines
        self.metrics = metrics
        self.costs = costs
        self.ledger: Ledger = costs.ledger
        #: Measures prompts off the event loop (length, block keys); None: estimate from chars.
        self.prompts = prompts
        #: The deployment's latency targets (a request's own ``slo`` overrides each).
        self.targets = targets or Targets()
        #: Times a request may move to another decode engine when its own is lost mid-answer.
        self.migration_limit = migration_limit
        #: The engines' context length (what a continuation of a chat stream may fill).
        self.max_model_len = max_model_len
        self._prefill = PrefillLeg(pool, self.ledger, costs, deadlines, metrics)
        #: The latest decisions and what came of them (``GET /pd/decisions``).
        self.decisions = DecisionLog()
        self._background: set[asyncio.Task] = set()

    async def serve(
        self, req: ApiRequest, prefill: Engine | None = None, decode: Engine | None = None
    ) -> Reply | Stream:
        """Serve ``req``; ``prefill``/``decode`` pin the engines (probes), else the cheapest.
        A decode engine lost mid-answer is replaced (``proxy/migration.py``): a stream is
        continued on another, a whole reply asked for again there (up to the limit each)."""
        pinned = prefill is not None or decode is not None
        limit = 0 if pinned else self.migration_limit
        if req.deadline is None:
            req = replace(req, deadline=asyncio.get_running_loop().time() + self.deadlines.total_s)
        if req.stream:
            why_not = not_migratable(req.body) if limit else "disabled"
            stream = await self._serve(with_token_ids(req) if why_not is None else req,
                                       prefill, decode)
            assert isinstance(stream, Stream)
            return replace(stream, chunks=migrating(
                req, stream.chunks, stream.engine, self._resume, limit, self.metrics,
                self.max_model_len, why_not))
        for attempt in range(limit + 1):
            try:
                return await self._serve(req, prefill, decode)
            except (DecodeLost, DecodeStalled) as exc:
                reason = "decode_lost" if isinstance(exc, DecodeLost) else "decode_timeout"
                decode = self.pool.pick_decode(self.costs.engine_load_tokens, exclude={exc.engine})
                if attempt == limit or decode is None:
                    self.metrics.migrations_failed_total.labels(
                        "limit" if decode is not None else "no_engine").inc()
                    raise
                self.metrics.migrations_total.labels(reason).inc()
                log.warning("%s: decode %s lost while answering: asked again on %s",
                            req.request_id, exc.engine, decode.name)
        raise AssertionError("unreachable")

    async def _resume(self, req: ApiRequest, failed: Collection[str]
                      ) -> tuple[AsyncIterator[bytes | ProxyError], str]:
        """``req`` (a stream's continuation) on a decode engine not in ``failed``: its chunks,
        and that engine's name. That engine failing before it answered is a ``DecodeLost`` of
        its own (another may be tried)."""
        decode = self.pool.pick_decode(self.costs.engine_load_tokens, exclude=failed)
        if decode is None:
            raise NoEngineAvailable("no other decode engine to continue the stream on")
        try:
            stream = await self._serve(req, None, decode)
        except (StageTimeout, UpstreamError) as exc:
            if isinstance(exc, RequestDeadline):
                raise
            raise DecodeLost(exc.message, engine=decode.name) from None
        assert isinstance(stream, Stream)
        return stream.chunks, stream.engine

    async def _serve(self, req: ApiRequest, prefill: Engine | None, decode: Engine | None
                     ) -> Reply | Stream:
        trace = Trace(time.perf_counter())
        plan = await self.plan(req, prefill, decode)
        self.metrics.decisions_total.labels(plan.decision.route, plan.decision.reason).inc()
        logged = self.decisions.record(req.request_id, str(self.policy), plan)
        # A stall budget needs the answer's length: without max_tokens, none (room 0 there).
        # A whole reply has no gaps to protect.
        itl_s = (plan.targets.itl_s if plan.targets and req.stream
                 and stated_output_budget(req.body) else None)
        claim = self.ledger.claim(plan.decode, output_tokens=plan.output_budget, itl_s=itl_s,
                                  stream=req.stream)
        disaggregated = plan.decision.route == "disaggregated" and plan.prefill is not None
        predicted = plan.decision.predicted_s()
        now = time.monotonic()
        if disaggregated and predicted is not None:  # routes decided now do not stall it before
            claim.expect_start(now + predicted)
        if plan.decision.stalls:  # the route spends the streams' stall budget there
            claim.hold_stalls(plan.decision.stalls,
                              until=now + predicted if predicted is not None else None)
        leg: DecodeLeg | None = None
        try:
            handoff = None
            if disaggregated:
                try:
                    handoff = await self._prefill.run(req, plan, trace)
                except asyncio.CancelledError:  # the client left; closing the request aborted it
                    self.metrics.client_disconnects_total.labels("before_response").inc()
                    raise
                finally:
                    claim.expect_start(None)  # its KV is on its way (or it is computed here)
            trace.t_handoff = time.perf_counter()
            leg = DecodeLeg(req, plan, trace, claim, handoff, pool=self.pool,
                            ledger=self.ledger, costs=self.costs, deadlines=self.deadlines,
                            metrics=self.metrics, background=self._background)
            if handoff is not None:
                trace.defer(lambda: self.metrics.stage_seconds.labels(
                    "prefill", leg.route).observe(trace.t_handoff - trace.t_start))
            try:
                if not req.stream:
                    data = await whole_reply(leg, self.metrics, self.pool)
                    logged.taken(leg.route, trace)
                    return Reply(leg.route, 200, data, leg.headers())
                stream = await leg.open()
                logged.taken(leg.route, trace)
            except asyncio.CancelledError:
                stage = "before_response"
                if leg.handoff is not None and not leg.answered:
                    stage = "after_prefill"
                    if req.stream:  # (a whole reply's KV may be pulled: release_blocks)
                        leg.release_blocks()
                self.metrics.client_disconnects_total.labels(stage).inc()
                raise
            assert req.deadline is not None  # set by serve()
            opened, ending = stream, leg

            def abandon() -> None:
                opened.close()
                ending.ended(time.perf_counter())

            return Stream(leg.route, relay(leg, stream, req.deadline, self.metrics, self.pool),
                          leg.headers(), leg.decode.name, abandon, req.deadline)
        except BaseException:
            if leg is not None:
                leg.ended(time.perf_counter())
            claim.release()
            trace.run_deferred()  # what the prefill measured holds even if decode failed
            raise

    async def plan(self, req: ApiRequest, prefill: Engine | None = None,
                   decode: Engine | None = None) -> Plan:
        """Measure the prompt (off the loop), then pick engines and route."""
        measured = None
        t0 = time.perf_counter()
        if self.prompts is not None:
            sizes = {e.index.block_size for e in self.pool.all() if e.index.block_size}
            measured = await self.prompts.measure(req.body, sorted(sizes))
        t1 = time.perf_counter()
        own = req.targets or Targets()
        targets = Targets(ttft_s=own.ttft_s or self.targets.ttft_s,
                          itl_s=own.itl_s or self.targets.itl_s)
        plan = make_plan(req, pool=self.pool, costs=self.costs, policy=self.policy,
                         prompt_chars=prompt_chars(req.body), measured=measured,
                         output_budget=output_budget(req.body), load=self.costs.engine_load_tokens,
                         prefill=prefill, decode=decode, targets=targets, now=time.monotonic())
        if req.spans is not None:
            prefill_name = plan.prefill.name if plan.prefill else None
            req.spans.hold("tokenize", t0, t1, prompt_tokens=plan.prompt_tokens)
            req.spans.stage("decision", t1, time.perf_counter(), route=plan.decision.route,
                            reason=plan.decision.reason, decode=plan.decode.name,
                            prefill=prefill_name)
            req.spans.decided(route=plan.decision.route, decode=plan.decode.name,
                              prefill=prefill_name)
        return plan
