"""The prefill leg: the prefill engine computes the prompt and hands its KV over.

``run_prefill`` returns the hand-off, or None when the prefill engine failed (the request is
then served locally; ``pd_fallbacks_total{reason}`` says why). A 4xx from the engine is the
client's fault and is raised as such. The prompt work is claimed on the prefill engine for the
call and released whatever happens; a cancellation (the client left) closes the request, which
makes vLLM abort it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from proxy.costs import RouteCosts
from proxy.deadlines import Deadlines, seconds_left
from proxy.engine import EngineLost
from proxy.engine_bodies import prefill_body
from proxy.engine_client import EngineClient, EngineTimeout, EngineUnreachable
from proxy.errors import RequestDeadline, from_engine_error
from proxy.ledger import Ledger
from proxy.metrics import ProxyMetrics
from proxy.plan import Plan
from proxy.pool import EnginePool
from proxy.requests import ApiRequest
from proxy.trace import Trace
from transport import kv_params

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillLeg:
    pool: EnginePool
    ledger: Ledger
    costs: RouteCosts
    deadlines: Deadlines
    metrics: ProxyMetrics

    async def run(self, req: ApiRequest, plan: Plan, trace: Trace
                  ) -> kv_params.PrefillHandoff | None:
        prefill = plan.prefill
        assert prefill is not None
        t0 = time.perf_counter()
        with self.ledger.claim(prefill, prompt_tokens=plan.prompt_tokens) as claim:
            # Timed alone: nothing else queued there, and no stream decoding there (a pool
            # engine may be doing both).
            tracker = self.costs.tracker(prefill.name)
            idle = claim.was_idle and tracker.streams == 0
            # Streams decoding there too (one pool) see this prompt's steps: time them.
            work = object()
            tracker.work_started(work, t0, plan.decision.gap_prefill_s, "prefill")
            headers = {"x-request-id": req.request_id}
            span = (req.spans.call("prefill", t0, headers, engine=prefill.name,
                                   route="disaggregated")
                    if req.spans is not None else None)
            try:
                with prefill.given_up_when_down():
                    reply = await prefill.client.post_json(
                        req.path, prefill_body(req.body, req.kv_limits), headers,
                        min(self.deadlines.prefill_s, seconds_left(req.deadline)))
                if 400 <= reply.status < 500:
                    raise from_engine_error(reply.status, reply.body)
                if reply.status != 200:
                    return self._fallback("prefill_error")
                prefill.stalls = 0  # it generated (``proxy/stalls.py``)
                handoff = kv_params.parse_prefill_json(reply.body)
                tracker.work_done(work, time.perf_counter(),
                                  prefill_tokens=handoff.num_prompt_tokens - handoff.cached_tokens)
            except EngineUnreachable:
                self.pool.mark_down(prefill)
                return self._fallback("prefill_unreachable")
            except EngineLost:  # marked down by a probe (or another request) meanwhile
                return self._fallback("prefill_lost")
            except EngineTimeout:
                if seconds_left(req.deadline) <= 0:  # (no time left to compute it locally)
                    raise RequestDeadline("the request did not finish within its deadline"
                                          ) from None
                self.pool.stalled(prefill)
                return self._fallback("prefill_timeout")
            except kv_params.HandoffError:
                return self._fallback("bad_handoff")
            finally:
                tracker.work_dropped(work, time.perf_counter())  # (a no-op once done)
                if req.spans is not None and span is not None:
                    req.spans.finish(span, time.perf_counter())
        seconds = time.perf_counter() - t0
        n = handoff.num_prompt_tokens
        self.costs.observe_prompt(plan.prompt_chars, n)
        if idle:
            new = n - handoff.cached_tokens
            trace.defer(lambda: self.costs.observe_remote_prefill(prefill.name, new, seconds))
        return handoff

    def _fallback(self, reason: str) -> kv_params.PrefillHandoff | None:
        """No hand-off (the request is served locally), counted by ``reason``."""
        log.warning("prefill failed (%s): serving locally", reason)
        self.metrics.fallbacks_total.labels(reason).inc()
        return None


def release_handoff(client: EngineClient, path: str, body: dict, request_id: str, read_by: float,
                    background: set[asyncio.Task]) -> None:
    """A decode request given up before its engine answered is aborted, maybe before vLLM took
    its hand-off. The prefill engine then holds the blocks until its lease expires unless a
    decode reads them: ``body`` (:func:`proxy.engine_bodies.release_body`, one token) reads them
    in the background, on the same engine ``client`` (another could read them while that one,
    resumed, reads them too: its prefix cache would then hold blocks the prefill has reused),
    for as long as the hand-off can still be read (``read_by``, wall clock)."""
    timeout_s = max(read_by - time.time(), 1.0)

    async def run() -> None:
        try:
            await client.post_json(path, body, {"x-request-id": request_id}, timeout_s)
        except Exception as exc:  # noqa: BLE001 - best effort; the lease frees them later
            log.warning("could not release prefill blocks of %s: %s", request_id, exc)

    task = asyncio.get_running_loop().create_task(run())
    background.add(task)
    task.add_done_callback(background.discard)
