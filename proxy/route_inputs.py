"""What the routing policy is told and what it answers (``proxy/policy.py``): frozen values,
made by ``proxy/plan.py`` from the live cost state (``proxy/costs.py``) and the ledger."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.stall_budget import Arrival, exposed
from transport.cost import LinkModel, PrefillModel, StepModel

Route = Literal["disaggregated", "local"]


@dataclass(frozen=True)
class CostInputs:
    """The live cost model for one prefill->decode pair (fitted by ``proxy/estimators.py``)."""

    kv_bytes_per_token: int
    remote_prefill: PrefillModel  # the prefill engine computing a prompt
    local_prefill: PrefillModel  # the decode engine computing a prompt itself
    link: LinkModel  # hand-over: prefill done -> decode's first token
    prefill_queue_s: float = 0.0  # work already queued on the prefill engine
    decode_queue_s: float = 0.0  # prompt work already queued on the decode engine
    #: The decode engine's step time (None: not known yet, gaps are not predicted).
    decode_step: StepModel | None = None
    #: The decode engine's prefill chunk: a longer prompt is computed over several steps.
    chunk_tokens: int = 2048
    #: The prefill engine's step time, when streams decode there too (an engine of the one-pool
    #: layout serves both roles): a prompt prefilled there stalls them as a local one would.
    prefill_step: StepModel | None = None
    #: Each route's TTFT correction factor, measured ÷ predicted as learned from the requests
    #: routed that way (``proxy/ttft_correction.py``): (disaggregated, local).
    ttft_correction: tuple[float, float] = (1.0, 1.0)
    #: Whether each route is predicted behind queued prompt work (a factor for each case).
    ttft_queued: tuple[bool, bool] = (False, False)


@dataclass(frozen=True)
class Targets:
    """Latency targets: time to first token and the longest gap between tokens (seconds)."""

    ttft_s: float | None = None
    itl_s: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None


@dataclass(frozen=True)
class RouteInputs:
    """What is known about one request and the engines that could serve it."""

    prompt_tokens: int
    prefill_cached_tokens: int = 0
    decode_cached_tokens: int = 0
    prefill_available: bool = True
    costs: CostInputs | None = None
    #: Streams decoding on the decode engine now, or about to (their KV is on its way, or their
    #: prompt queued there): what a local prefill would stall.
    streams: int = 0
    targets: Targets | None = None
    #: Gaps over the gap target that each of those streams can still take with its p99 gap within
    #: the target (:func:`stall_allowance`, less the stalls it had): the fewest.
    stall_room: int = 0
    #: Requests bound to the decode engine, still being prefilled elsewhere: counted with the
    #: streams by a route whose steps there end after they start decoding (``exposure``).
    arriving: tuple[Arrival, ...] = ()
    #: Streams decoding on the prefill engine (an engine that serves both roles): what the
    #: disaggregated route's prefill stalls there. They spend no stall budget (room 0).
    prefill_streams: int = 0


def exposure(inputs: RouteInputs, within_s: float | None) -> tuple[int, int]:
    """The streams a route's steps stall, and their room (``proxy/stall_budget.py``)."""
    return exposed(inputs.streams, inputs.stall_room, inputs.arriving, within_s)


@dataclass(frozen=True)
class Decision:
    route: Route
    reason: str
    predicted_disaggregated_s: float | None = None
    predicted_local_s: float | None = None
    #: The longest gap the route would put between the running streams' tokens (None: no
    #: streams, or no step model).
    gap_disaggregated_s: float | None = None
    gap_local_s: float | None = None
    stall_room: int = 0  # what the streams could still take (``RouteInputs.stall_room``)
    #: Stalls the route spends from every other stream's budget (``slo_stall_budget``).
    stalls: int = 0
    streams: int = 0  # the streams the route's steps on the decode engine stall (``exposure``)
    #: The longest gap the disaggregated route's prefill puts between the tokens of the streams
    #: decoding on the prefill engine (``RouteInputs.prefill_streams``; None: none there).
    gap_prefill_s: float | None = None
    #: With targets: the requests the route is predicted to put over one (the arrival, and the
    #: streams it stalls past their room), and by how much (``proxy/slo_rule.py``): how the
    #: pair of engines is picked where engines serve both roles (``proxy/pair_choice.py``).
    over_targets: int = 0
    violation: float = 0.0
    #: The TTFT correction factors the predictions include (``CostInputs.ttft_correction``),
    #: and for which case (``CostInputs.ttft_queued``): what the measured TTFT corrects.
    ttft_correction: tuple[float, float] = (1.0, 1.0)
    ttft_queued: tuple[bool, bool] = (False, False)

    def predicted_s(self) -> float | None:
        return self.predicted_disaggregated_s if self.route == "disaggregated" else (
            self.predicted_local_s
        )

    def predicted_gap_s(self) -> float | None:
        return self.gap_disaggregated_s if self.route == "disaggregated" else self.gap_local_s
