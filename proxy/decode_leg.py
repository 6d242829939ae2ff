"""The decode leg: the decode engine pulls the hand-off's KV (or computes the prompt itself),
then answers; retried on another decode engine when the first cannot be reached.

A :class:`DecodeLeg` holds the request's claim on its decode engine from the plan on and is the
one place it is released: :func:`proxy.relay.whole_reply` (a reply read in full),
:func:`proxy.relay.relay` (a stream, when it ends however it ends), or the orchestrator when
the request fails before either (``claim.release`` is idempotent). Call order: ``open()`` once,
then the relay (or ``whole_reply``); ``first_byte(now)`` when the client has its first
bytes; ``release_blocks()``: see there. An engine marked down while the leg waits for its
answer (its probes unanswered: hung, or cut off) is given up like one unreachable, when
another decode engine can take the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import Histogram

from proxy.costs import RouteCosts
from proxy.deadlines import Deadlines, seconds_left
from proxy.engine import EngineLost
from proxy.engine_bodies import decode_body, release_body
from proxy.engine_client import EngineStream, EngineTimeout, EngineUnreachable
from proxy.errors import (
    RequestDeadline,
    StageTimeout,
    UpstreamError,
    from_engine_error,
)
from proxy.ledger import Claim, Ledger
from proxy.metrics import ProxyMetrics
from proxy.pair_health import Handover
from proxy.plan import Plan, estimate_header
from proxy.pool import Engine, EnginePool
from proxy.prefill_leg import release_handoff
from proxy.requests import ApiRequest
from proxy.trace import Trace
from transport import kv_params

log = logging.getLogger(__name__)


class DecodeLeg:
    def __init__(self, req: ApiRequest, plan: Plan, trace: Trace, claim: Claim,
                 handoff: kv_params.PrefillHandoff | None, *, pool: EnginePool, ledger: Ledger,
                 costs: RouteCosts, deadlines: Deadlines, metrics: ProxyMetrics,
                 background: set[asyncio.Task]):
        self.req, self.plan, self.trace, self.claim = req, plan, trace, claim
        self._pool, self._ledger, self._costs = pool, ledger, costs
        self._deadlines, self._metrics, self._background = deadlines, metrics, background
        self.handoff = handoff
        self.route = "disaggregated" if handoff is not None else "local"
        # The prefill engine frees the blocks when its lease ends; they may then be reused.
        self.read_by = time.time() + deadlines.handoff_max_age_s
        #: The decode engine sent its response headers (it has the request).
        self.answered = False
        #: The decode engine computes the prompt: timed alone when nothing else was queued.
        self.local_was_idle = handoff is None and claim.add_prompt(plan.decode_new_tokens)
        self._streaming, self._streams_at_send = False, 0
        #: No prompt work of this proxy was queued on the decode engine when the KV went there:
        #: the hand-over then times the link, not a wait behind a local prefill.
        self._kv_in_alone = False
        self._last_frame_at = 0.0
        self._itl: Histogram | None = None  # pd_itl_seconds{route}
        self._decode_span: Any = None  # the open ``decode`` span, when tracing
        self._handover: Handover | None = None  # the KV sent to the engine tried now
        self.body = decode_body(req.body, handoff, self.read_by, req.kv_limits)

    @property
    def decode(self) -> Engine:
        return self.claim.engine

    async def open(self) -> EngineStream:
        """Send the decode request; an engine unreachable (it saw nothing: any can pull the KV)
        or answering 5xx (its core dead: the next computes the prompt) is replaced, once each."""
        tried: set[str] = set()
        while True:
            decode = self.decode
            tried.add(decode.name)
            self._pull_over()  # (the engine tried before)
            if self.handoff is not None and self.plan.prefill is not None:
                self._handover = self._pool.handing_over(self.plan.prefill, decode)
            self.trace.t_decode_sent = time.perf_counter()
            # The streams decoding there will see this arrival's steps: time them.
            tracker = self._costs.tracker(decode.name)
            self._streams_at_send = tracker.streams
            self._kv_in_alone = self._ledger.load(decode.name).prompt_tokens == 0
            tracker.work_started(self, self.trace.t_decode_sent,
                                 self.plan.decision.predicted_gap_s(), self.route)
            headers = {"x-request-id": self.req.request_id}
            if self.req.spans is not None:
                self._end_decode_span(self.trace.t_decode_sent, error="retried")
                self._decode_span = self.req.spans.call(
                    "decode", self.trace.t_decode_sent, headers, engine=decode.name,
                    route=self.route)
            try:
                headers_s = self._deadlines.decode_headers_s(self.req.stream,
                                                             self.req.deadline)
                with decode.given_up_when_down(if_replaced=True):  # (marked down: hung)
                    stream = await decode.client.open_stream(
                        self.req.path, self.body, headers, headers_s, self._deadlines.idle_s)
                if stream.status < 400 or (stream.status < 500 and self.handoff is None):
                    break
                error = from_engine_error(stream.status, await stream.read_and_close())
                if stream.status < 500:  # to a hand-off: the client's error, or one it caused
                    if not kv_params.names_handoff(error.param):  # (the proxy alone sends them)
                        raise error
                    tracker.work_dropped(self, time.perf_counter())
                    self._recompute_instead("handoff_refused")  # here (vLLM frees the blocks)
                    continue
                if not self._move_on(decode, tried, f"answered {stream.status}"):
                    raise error
                if self.handoff is not None:
                    self._recompute_instead("handoff_maybe_read")
            except (EngineUnreachable, EngineLost) as exc:
                # Lost: marked down (its probes unanswered) while it had the request, which it
                # may read (and its KV) if it ever resumes.
                delivered = not isinstance(exc, EngineUnreachable) or exc.delivered
                self._pool.mark_down(decode)
                if not self._move_on(decode, tried, "unreachable"):
                    raise UpstreamError("the decode engine is unreachable") from None
                if self.handoff is not None and (delivered or time.time() > self.read_by):
                    self._recompute_instead("handoff_maybe_read" if delivered
                                            else "handoff_expired")
            except EngineTimeout:
                self._costs.tracker(decode.name).work_dropped(self, time.perf_counter())
                if self.handoff is not None and self.req.stream:
                    # Resumed, the engine may drop the request before vLLM's serving layer sees
                    # its hand-off (then nothing frees the prefill's blocks before the lease).
                    self.release_blocks()
                if seconds_left(self.req.deadline) <= 0:
                    raise RequestDeadline("the request did not finish within its deadline"
                                          ) from None
                self._pool.stalled(decode)
                raise StageTimeout("the decode engine did not answer in time") from None
        self.answered = True
        if stream.status != 200:
            raise from_engine_error(stream.status, await stream.read_and_close())
        return stream

    def _move_on(self, failed: Engine, tried: set[str], why: str) -> bool:
        """Move the claim to a decode engine not yet ``tried``; False when there is none."""
        self._costs.tracker(failed.name).work_dropped(self, time.perf_counter())
        other = self._pool.pick_decode(self._costs.engine_load_tokens, exclude={failed.name})
        if other is None or other.name in tried:
            return False
        log.warning("decode %s %s: retrying %s on %s", failed.name, why, self.req.request_id,
                    other.name)
        self._metrics.fallbacks_total.labels("decode_retried").inc()
        self.claim.move_to(other)
        self.local_was_idle = self.local_was_idle and self.claim.was_idle
        return True

    def _recompute_instead(self, reason: str) -> None:
        """Drop the hand-off: the next decode engine computes the prompt itself. Used when the
        engine that failed may have read the KV already (its read freed the prefill's blocks),
        when the prefill's lease on them is nearly over (a late read: silent garbage), or when
        the engine refused it."""
        log.warning("%s: the retry computes the prompt (%s)", self.req.request_id, reason)
        self._metrics.fallbacks_total.labels(reason).inc()
        self.handoff = None
        self.route = "local"
        self.local_was_idle = self.claim.add_prompt(self.plan.decode_new_tokens)
        self.body = decode_body(self.req.body, None, self.read_by, self.req.kv_limits)

    def first_byte(self, now: float) -> None:
        """The client has its first bytes: the claim and the step tracker move on now, what they
        measured is recorded on the loop's next turn (the bytes right behind them, a chat
        stream's first token after its role event, are not held up by histograms and fits)."""
        self.claim.prompt_done()
        self.claim.drop_hold()  # its steps are over: their gaps are relayed, or about to be
        new, local = self.plan.decode_new_tokens, self.handoff is None
        tracker = self._costs.tracker(self.decode.name)
        tracker.work_done(self, now, prefill_tokens=new if local else 0,
                          kv_tokens=0 if local else new)
        tracker.stream_started(self, now)
        self._streaming = True
        self.trace.t_first = now
        self._pull_over()
        if self.req.spans is not None:
            self._trace_first_byte(now)
        # (Read now: a hand-over behind a local prefill times that wait, not the link: LinkFit.)
        alone = self._kv_in_alone and self._ledger.load(self.decode.name).prompt_tokens == 0
        asyncio.get_running_loop().call_soon(self._measured, now, alone)

    def _pull_over(self) -> None:  # the decode engine answered, or failed: its pull is over
        if self._handover is not None:
            self._pool.pulled(self._handover)
            self._handover = None

    def _measured(self, now: float, kv_in_alone: bool) -> None:
        """What the first bytes at ``now`` measured (``kv_in_alone``: see above)."""
        plan, trace = self.plan, self.trace
        trace.run_deferred()
        ttft = now - trace.t_start
        self._metrics.stage_seconds.labels("ttft", self.route).observe(ttft)
        predicted = plan.decision.predicted_s() if self.route == plan.decision.route else None
        if predicted:
            self._metrics.ttft_prediction_ratio.labels(self.route).observe(ttft / predicted)
            if self.decode is plan.decode:  # (not a retry elsewhere: another engine's time)
                prefill = plan.prefill.name if plan.prefill is not None else None
                queued = plan.decision.ttft_queued[self.route == "local"]
                self._costs.observe_ttft(self.route, prefill, self.decode.name,
                                         plan.prompt_tokens, ttft / predicted, queued)
        if self.handoff is not None and plan.prefill is not None:
            handover = now - trace.t_handoff
            self._metrics.stage_seconds.labels("handover", self.route).observe(handover)
            moved = self.handoff.num_prompt_tokens - plan.decode_cached_tokens
            if kv_in_alone:
                self._costs.observe_handover(plan.prefill.name, self.decode.name, moved,
                                             handover)
            pair = (plan.prefill.name, self.decode.name)
            self._metrics.handover_seconds.labels(*pair).observe(handover)
            self._metrics.kv_moved_bytes_total.labels(*pair).inc(
                max(moved, 0) * self._costs.kv_bytes_per_token)
        elif self.local_was_idle and not self._streams_at_send:
            # Timed alone: no other prompt work queued and no stream decoding beside it (each
            # step would also have decoded those, which the step model accounts for).
            self._costs.observe_local_prefill(self.decode.name, plan.decode_new_tokens,
                                              now - trace.t_decode_sent)

    def _trace_first_byte(self, now: float) -> None:
        spans, plan = self.req.spans, self.plan
        assert spans is not None
        self._end_decode_span(now)
        prefill = plan.prefill.name if plan.prefill is not None and self.handoff else None
        if prefill is not None:
            spans.stage("handover", self.trace.t_handoff, now, prefill=prefill,
                        decode=self.decode.name, route=self.route)
        spans.annotate(route=self.route, prefill=prefill, decode=self.decode.name)

    def _end_decode_span(self, now: float, **attributes: Any) -> None:
        if self._decode_span is not None and self.req.spans is not None:
            self.req.spans.finish(self._decode_span, now, **attributes)
            self._decode_span = None

    def frames(self, now: float, frames: int) -> None:
        """``frames`` more tokens relayed at ``now``."""
        self.claim.output_done(frames)
        self._costs.tracker(self.decode.name).frame(self, now, frames)
        if frames:  # the gap each token of this chunk waited, from the second chunk on
            if self._itl is None:
                self._itl = self._metrics.itl_seconds.labels(self.route)
            else:
                gap = (now - self._last_frame_at) / frames
                self._itl.observe(gap)
                if self.claim.itl_s is not None and gap > self.claim.itl_s:
                    self.claim.stalled()
            self._last_frame_at = now

    def ended(self, now: float) -> None:
        """The request is over on its decode engine, however it ended."""
        self.claim.release()  # first: nothing below can keep it
        self._pull_over()
        tracker = self._costs.tracker(self.decode.name)
        tracker.work_dropped(self, now)  # (a no-op once its first byte came)
        if self._streaming:
            tracker.stream_ended(self)
        self.trace.run_deferred()
        if self.req.spans is not None:
            self._end_decode_span(now)  # a whole reply, or no first byte
            if t_first := self.trace.t_first:
                self.req.spans.stage("relay", t_first, now, engine=self.decode.name,
                                     route=self.route)
            else:
                self.req.spans.annotate(route=self.route, decode=self.decode.name)

    def release_blocks(self) -> None:
        """The decode request was given up before its engine answered (the client left, or the
        engine missed the headers deadline): its hand-off is read in the background
        (:func:`proxy.prefill_leg.release_handoff`). Streams only (their headers come before
        the pull): a whole reply's come with its last token, its KV maybe pulled and freed long
        before (read again: garbage in the decode engine's cache). vLLM frees an aborted one."""
        release_handoff(self.decode.client, self.req.path, release_body(self.body),
                        self.req.request_id, self.read_by, self._background)

    def headers(self) -> dict[str, str]:
        headers = {"x-request-id": self.req.request_id, "x-pd-route": self.route}
        if (estimate := estimate_header(self.plan)) is not None:
            headers["x-pd-estimate"] = estimate
        return headers

