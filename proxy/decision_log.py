"""The latest routing decisions, for operators and benchmarks (``GET /pd/decisions``).

A bounded ring of :class:`Entry` (the newest ``CAPACITY``; older ones are dropped), one per
decision: the request's id (its ``x-request-id``, which clients such as ``vllm bench serve``
set), the engines, the route and its reason, what the policy was told and what it predicted;
then, once known, the route the request really took and its measured time to first token. It
answers "why did this request go there, and was the prediction right" for one request, where
the metrics only count.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from proxy.plan import Plan
from proxy.trace import Trace

#: Entries kept: a few minutes of traffic at a few requests a second (a few hundred bytes each).
CAPACITY = 4096


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass(slots=True)
class Entry:
    request_id: str
    at: float  # unix time of the decision
    policy: str
    plan: Plan
    #: The route the request took (a failed prefill falls back to local) once its decode
    #: engine answered, and its stage times (the TTFT, once the client has its first bytes).
    route_taken: str | None = None
    trace: Trace | None = None

    def taken(self, route: str, trace: Trace) -> None:
        self.route_taken, self.trace = route, trace

    @property
    def ttft_s(self) -> float | None:
        t = self.trace
        return t.t_first - t.t_start if t is not None and t.t_first else None

    def view(self) -> dict[str, Any]:
        d, plan = self.plan.decision, self.plan
        targets = plan.targets
        return {
            "request_id": self.request_id, "at": round(self.at, 3), "policy": self.policy,
            "route": d.route, "reason": d.reason,
            "prefill": plan.prefill.name if plan.prefill else None, "decode": plan.decode.name,
            "prompt_tokens": plan.prompt_tokens,
            "decode_cached_tokens": plan.decode_cached_tokens,
            "streams": d.streams, "stall_room": d.stall_room, "stalls": d.stalls,
            "targets_ms": {"ttft": _ms(targets.ttft_s), "itl": _ms(targets.itl_s)}
            if targets is not None and targets.any else None,
            "predicted_ttft_ms": {"disaggregated": _ms(d.predicted_disaggregated_s),
                                  "local": _ms(d.predicted_local_s)},
            # (the factors those predictions include: ``proxy/ttft_correction.py``)
            "ttft_correction": dict(zip(("disaggregated", "local"),
                                        (round(f, 3) for f in d.ttft_correction), strict=True)),
            "predicted_gap_ms": {"disaggregated": _ms(d.gap_disaggregated_s),
                                 "local": _ms(d.gap_local_s),
                                 "prefill_engine": _ms(d.gap_prefill_s)},
            "route_taken": self.route_taken, "ttft_ms": _ms(self.ttft_s),
        }


class DecisionLog:
    def __init__(self, capacity: int = CAPACITY):
        self._entries: deque[Entry] = deque(maxlen=capacity)

    def record(self, request_id: str, policy: str, plan: Plan) -> Entry:
        entry = Entry(request_id, time.time(), policy, plan)
        self._entries.append(entry)
        return entry

    def recent(self, limit: int, request_id: str | None = None, prefix: str | None = None
               ) -> list[dict[str, Any]]:
        """Up to ``limit`` entries, newest first: all, one request's, or those whose id starts
        with ``prefix``."""
        out: list[dict[str, Any]] = []
        for entry in reversed(self._entries):
            if len(out) >= limit:
                break
            if request_id is not None and entry.request_id != request_id:
                continue
            if prefix is not None and not entry.request_id.startswith(prefix):
                continue
            out.append(entry.view())
        return out
