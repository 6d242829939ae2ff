"""Which route a request takes: a pure function of what the proxy knows when the request arrives.

``disaggregated``: prefill engine computes the prompt, decode pulls its KV over NIXL.
``local``: the decode engine computes the prompt itself (no KV moves).

Modes: ``auto`` (the cheaper predicted time to first token, from the live cost model),
``disaggregate`` (always, when a prefill engine is up), ``local`` (never), and ``threshold:N``
(disaggregate when the uncached prompt is at least N tokens, the llm-d / Dynamo rule).

``auto`` with targets (the deployment's ``--slo-ttft-ms``/``--slo-itl-ms``, or the request's
own ``slo``) also weighs the streams decoding on the chosen decode engine: a local prefill
stalls each of them for its chunked steps, a disaggregated arrival costs them the step that
takes its KV in (``StepModel``). Local is taken whenever it meets both targets with the
fits' own error to spare (``LOCAL_MARGIN``): the prefill is *deflected* onto the decode engine,
as far as the running streams allow (the rule of "load-aware prefill deflection"). Moving the
KV then would occupy a second engine and the link for nothing the targets ask for, and the
prefill engine is what later long prompts queue on. Otherwise the routes that meet both
targets are kept and the one with the most slack taken (local when the slacks are within
``SLACK_TIE``); with a gap target alone, the faster (the arrival's TTFT is what is left);
when none does, the fewest requests over a target (the arrival, and each stream stalled past
its room), then the least violation.

The gap target is each stream's p99 gap (nearest rank): a stream of n gaps may have
``stall_allowance(n)`` over it. A route over the target still meets it (no gap slack) when the
streams it stalls have that many left (``RouteInputs.stall_room``) for its ``stalls_needed``:
reason ``slo_stall_budget``; one under it by less than the fits' error spends them too. No
clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from proxy.policy_mode import PolicyMode
from proxy.policy_mode import parse_policy as parse_policy  # (re-exported)
from proxy.stall_budget import Arrival, exposed, stalls_needed
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

    def predicted_s(self) -> float | None:
        return self.predicted_disaggregated_s if self.route == "disaggregated" else (
            self.predicted_local_s
        )

    def predicted_gap_s(self) -> float | None:
        return self.gap_disaggregated_s if self.route == "disaggregated" else self.gap_local_s


def predict(inputs: RouteInputs, costs: CostInputs) -> tuple[float, float]:
    """Predicted seconds to first token: (disaggregated, local)."""
    n = inputs.prompt_tokens
    remote_new = max(0, n - inputs.prefill_cached_tokens)
    local_new = max(0, n - inputs.decode_cached_tokens)
    moved = local_new  # decode loads its own cached prefix and pulls only the rest
    # The decode engine takes the KV in and computes the first token in its own steps, after
    # the prompt work queued there before it (vLLM schedules what runs before what waits): a
    # short prompt prefilled elsewhere while a long one is computed there waits for it too
    # (SmolLM2, 64 tokens behind 1,024 prefilled on the decode engine: 4.4-4.8 s, as local).
    disagg = max(
        costs.prefill_queue_s + costs.remote_prefill.seconds(remote_new), costs.decode_queue_s
    ) + costs.link.seconds(moved, costs.kv_bytes_per_token)
    local = costs.decode_queue_s + costs.local_prefill.seconds(local_new)
    step = costs.decode_step
    if step is not None and inputs.streams and local_new:
        # It waits for the step in flight, half of one on average (the local fit is timed
        # alone: beside streams, 64-token prompts took 4.6-11 ms more on tiny, 17-32 ms on
        # SmolLM2, growing with the streams; goodput runs s36, s37).
        local += 0.5 * step.seconds(0, inputs.streams)
    streams, _ = exposure(inputs, local)
    if step is not None and streams:  # each chunk's step also decodes them
        local += _chunks(local_new, costs.chunk_tokens) * step.stream_s * streams
    return disagg, local


def _chunks(tokens: int, chunk_tokens: int) -> int:
    return -(-tokens // max(1, chunk_tokens)) if tokens > 0 else 0


def predict_gaps(inputs: RouteInputs, costs: CostInputs,
                 predicted: tuple[float, float] | None = None
                 ) -> tuple[float | None, float | None]:
    """The longest gap between the running streams' tokens each route causes: (disaggregated,
    local): the step during which the KV comes in, or the one that computes the largest prompt
    chunk (``StepModel.handover_gap``, ``local_gap``), with the streams exposed until the
    route's first token (``predicted``: the TTFTs, else ``predict``'s); None for none, or no
    step model."""
    step = costs.decode_step
    if step is None:
        return None, None
    predicted = predicted or predict(inputs, costs)
    new = max(0, inputs.prompt_tokens - inputs.decode_cached_tokens)
    disagg, local = exposure(inputs, predicted[0])[0], exposure(inputs, predicted[1])[0]
    return (step.handover_gap(disagg, new) if disagg > 0 else None,
            step.local_gap(new, costs.chunk_tokens, local) if local > 0 else None)


def decide(mode: PolicyMode, inputs: RouteInputs) -> Decision:
    predicted: tuple[float | None, float | None] = (None, None)
    gaps: tuple[float | None, float | None] = (None, None)
    if inputs.costs is not None:
        predicted = predict(inputs, inputs.costs)
        gaps = predict_gaps(inputs, inputs.costs, predicted)

    def made(route: Route, reason: str) -> Decision:
        ttft = predicted[0] if route == "disaggregated" else predicted[1]
        streams, room = exposure(inputs, ttft)
        return Decision(route, reason, *predicted, *gaps, room, streams=streams)

    if not inputs.prefill_available:
        return made("local", "prefill_unavailable")
    if mode.kind == "local":
        return made("local", "policy_local")
    if mode.kind == "disaggregate":
        return made("disaggregated", "policy_disaggregate")
    uncached = max(0, inputs.prompt_tokens - inputs.decode_cached_tokens)
    if mode.kind == "threshold":
        over = uncached >= mode.threshold_tokens
        return made("disaggregated", "over_threshold") if over else made("local", "under_threshold")
    # auto
    if inputs.costs is None:
        return made("disaggregated", "no_cost_model")
    if inputs.targets is not None and inputs.targets.any:
        route, reason = _for_targets(inputs, inputs.targets, predicted, gaps)
        spent = stalls_needed(route, uncached, inputs.costs.chunk_tokens)
        return replace(made(route, reason), stalls=spent if reason == "slo_stall_budget" else 0)
    if uncached == 0:
        return made("local", "cached_on_decode")
    disagg_s, local_s = predicted
    assert disagg_s is not None and local_s is not None
    if disagg_s < local_s:
        return made("disaggregated", "transfer_cheaper")
    if inputs.costs.prefill_queue_s > inputs.costs.decode_queue_s and (
        disagg_s - inputs.costs.prefill_queue_s < local_s
    ):
        return made("local", "prefill_congested")
    return made("local", "recompute_cheaper")


#: Slack (a share of the target) within which two routes that meet every target count as equal.
SLACK_TIE = 0.05
#: The share of each target a local prefill must leave unused to be taken whenever it meets
#: them: the prediction accuracy the fits are held to (TTFT within 15 %, the streams' worst
#: gap within 25 %), so that a prediction that errs by that much still meets the target.
LOCAL_MARGIN = Targets(ttft_s=0.15, itl_s=0.25)


def _for_targets(inputs: RouteInputs, targets: Targets, predicted: tuple[float | None, ...],
                 gaps: tuple[float | None, ...]) -> tuple[Route, str]:
    """Local when it meets both targets with ``LOCAL_MARGIN`` to spare; else keep the routes
    that meet both targets and take the one with the most slack (with a gap target alone, the
    faster); when none does, the fewest requests over a target, then the least violation (the
    streams' ITL violation counted once per stream)."""
    routes: list[Route] = ["disaggregated", "local"] if inputs.prefill_available else ["local"]
    index = {"disaggregated": 0, "local": 1}
    exposed = {r: exposure(inputs, predicted[index[r]]) for r in routes}

    costs = inputs.costs
    assert costs is not None  # (decide: no targets rule without a cost model)
    budgeted: set[Route] = set()  # routes over the gap target that the streams' room absorbs
    uncached = max(0, inputs.prompt_tokens - inputs.decode_cached_tokens)

    def judged(route: Route) -> tuple[bool, bool, float, float, int]:
        ttft = predicted[index[route]] or 0.0
        gap = gaps[index[route]]
        streams, room = exposed[route]
        ttft_ok = targets.ttft_s is None or ttft <= targets.ttft_s
        itl_ok = targets.itl_s is None or gap is None or gap <= targets.itl_s
        needed = stalls_needed(route, uncached, costs.chunk_tokens)
        if not itl_ok and room >= needed:
            itl_ok = True  # each stream's p99 gap stays within the target: no slack left
            budgeted.add(route)
            gap = targets.itl_s
        elif streams and room >= needed and gap is not None and targets.itl_s is not None and (
                gap > targets.itl_s * (1 - (LOCAL_MARGIN.itl_s or 0.0))):
            # Under the target by less than the fit's error: it may land over (SmolLM2, s38:
            # 233-245 ms predicted, 250-260 measured, 236 target). Its stalls are held.
            budgeted.add(route)
        slacks = [(targets.ttft_s - ttft) / targets.ttft_s] if targets.ttft_s else []
        if targets.itl_s and gap is not None:
            slacks.append((targets.itl_s - gap) / targets.itl_s)
        violation = (max(0.0, ttft / targets.ttft_s - 1) if targets.ttft_s else 0.0) + (
            streams * max(0.0, gap / targets.itl_s - 1) if targets.itl_s and gap else 0.0)
        misses = (not ttft_ok) + (0 if itl_ok else streams)
        return ttft_ok, itl_ok, min(slacks, default=0.0), violation, misses

    verdicts = {r: judged(r) for r in routes}
    meeting = [r for r in routes if verdicts[r][0] and verdicts[r][1]]
    if "local" in meeting and len(routes) > 1 and _with_margin(
            predicted[1] or 0.0, gaps[1], targets, exposed["local"][0]):
        return "local", "slo_local_fits"
    if len(meeting) > 1 and targets.ttft_s is None:
        # Only the gap is a target and both meet it: the arrival's TTFT is left to win (local
        # within SLACK_TIE). Most gap slack moved short prompts to queue behind long ones on
        # the prefill engine for a stall the target allows (1.2-4 s against 0.2 s local).
        ttft = {r: predicted[index[r]] or 0.0 for r in meeting}
        best = min(meeting, key=ttft.__getitem__)
        if ttft["local"] <= ttft[best] * (1 + SLACK_TIE):
            best = "local"
        return best, "slo_stall_budget" if best in budgeted else "slo_fastest"
    if meeting:
        # Most slack; within SLACK_TIE a tie, taken by local: moving the KV would occupy a
        # second engine and the link for what the fits cannot tell apart.
        best = max(meeting, key=lambda r: (verdicts[r][2], -(predicted[index[r]] or 0.0)))
        if "local" in meeting and verdicts[best][2] - verdicts["local"][2] < SLACK_TIE:
            best = "local"
        if best in budgeted:
            return best, "slo_stall_budget"
        if len(meeting) == len(routes):
            return best, "slo_most_slack"
        other = next(r for r in routes if r != best)
        return best, "slo_protects_streams" if not verdicts[other][1] else "slo_ttft_target"
    # Goodput counts requests: an arrival late either way loses nothing more by waiting, the
    # streams a local prefill stalls would be lost with it (SmolLM2, goodput_mixed_s39).
    best = min(routes, key=lambda r: (verdicts[r][4], verdicts[r][3],
                                      predicted[index[r]] or 0.0))
    return best, "slo_least_violation"


def _with_margin(ttft: float, gap: float | None, targets: Targets, streams: int) -> bool:
    """The route's predictions leave ``LOCAL_MARGIN`` of each target set unused. A gap target
    with streams running but no step model to predict their gap is not known to be met."""
    assert LOCAL_MARGIN.ttft_s is not None and LOCAL_MARGIN.itl_s is not None
    if targets.ttft_s is not None and ttft > targets.ttft_s * (1 - LOCAL_MARGIN.ttft_s):
        return False
    if targets.itl_s is None or streams <= 0:
        return True
    return gap is not None and gap <= targets.itl_s * (1 - LOCAL_MARGIN.itl_s)
