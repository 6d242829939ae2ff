"""The targets rule of the ``auto`` policy (``proxy/policy.py``): which route meets the request's
time-to-first-token and gap targets, weighing the streams each route stalls. Pure.

Local is taken whenever it meets both targets with the fits' own error to spare
(``LOCAL_MARGIN``). Otherwise the routes that meet both targets are kept and the one with the
most slack taken (local within ``SLACK_TIE``); with a gap target alone, the faster; when none
does, the fewest requests over a target, then the least violation.

A disaggregated route stalls two sets of streams: the decode engine's, for the step that takes
the KV in, and, when its prefill engine decodes too (one pool), that engine's, for each chunk
of the prompt. The second set spends no stall budget: the ledger holds stalls on the decode
engine's requests only.
"""

from __future__ import annotations

from typing import NamedTuple

from proxy.route_inputs import Route, RouteInputs, Targets, exposure
from proxy.stall_budget import stalls_needed

#: Slack (a share of the target) within which two routes that meet every target count as equal.
SLACK_TIE = 0.05
#: The share of each target a local prefill must leave unused to be taken whenever it meets
#: them: the prediction accuracy the fits are held to (TTFT within 15 %, the streams' worst
#: gap within 25 %), so that a prediction that errs by that much still meets the target.
LOCAL_MARGIN = Targets(ttft_s=0.15, itl_s=0.25)


class Verdict(NamedTuple):
    route: Route
    reason: str
    #: The requests the route is predicted to put over a target, and its violation.
    over_targets: int
    violation: float
    #: Whether the route spends the streams' stall budget (its stalls are to be held).
    spends_budget: bool


def for_targets(inputs: RouteInputs, targets: Targets, predicted: tuple[float | None, ...],
                gaps: tuple[float | None, ...], prefill_gap: float | None = None) -> Verdict:
    """Local when it meets both targets with ``LOCAL_MARGIN`` to spare; else keep the routes
    that meet both targets and take the one with the most slack (with a gap target alone, the
    faster); when none does, the fewest requests over a target, then the least violation (the
    streams' ITL violation counted once per stream). ``prefill_gap``: the gap the
    disaggregated route's prefill puts in the prefill engine's streams
    (``RouteInputs.prefill_streams``). Also returns the route's shortfall: the requests it is
    predicted to put over a target, and its violation (``Decision.over_targets``), and whether
    it spends the streams' stall budget, whatever the reason it was taken for."""
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
        stalled = [(streams, gap)]
        if route == "disaggregated" and prefill_gap is not None:
            stalled.append((inputs.prefill_streams, prefill_gap))
            itl_ok = itl_ok and (targets.itl_s is None or prefill_gap <= targets.itl_s)
        violation = max(0.0, ttft / targets.ttft_s - 1) if targets.ttft_s else 0.0
        misses = 0 if ttft_ok else 1
        for n, g in stalled:
            if targets.itl_s and g is not None:
                slacks.append((targets.itl_s - g) / targets.itl_s)
                violation += n * max(0.0, g / targets.itl_s - 1)
                misses += n if g > targets.itl_s else 0
        return ttft_ok, itl_ok, min(slacks, default=0.0), violation, misses

    verdicts = {r: judged(r) for r in routes}

    def verdict(route: Route, reason: str) -> Verdict:
        return Verdict(route, reason, verdicts[route][4], verdicts[route][3], route in budgeted)

    meeting = [r for r in routes if verdicts[r][0] and verdicts[r][1]]
    if "local" in meeting and len(routes) > 1 and _with_margin(
            predicted[1] or 0.0, gaps[1], targets, exposed["local"][0]):
        return verdict("local", "slo_local_fits")
    if len(meeting) > 1 and targets.ttft_s is None:
        # Only the gap is a target and both meet it: the arrival's TTFT is left to win (local
        # within SLACK_TIE). Most gap slack moved short prompts to queue behind long ones on
        # the prefill engine for a stall the target allows (1.2-4 s against 0.2 s local).
        ttft = {r: predicted[index[r]] or 0.0 for r in meeting}
        best = min(meeting, key=ttft.__getitem__)
        if ttft["local"] <= ttft[best] * (1 + SLACK_TIE):
            best = "local"
        reason = "slo_stall_budget" if best in budgeted else "slo_fastest"
        return verdict(best, reason)
    if meeting:
        # Most slack; within SLACK_TIE a tie, taken by local: moving the KV would occupy a
        # second engine and the link for what the fits cannot tell apart.
        best = max(meeting, key=lambda r: (verdicts[r][2], -(predicted[index[r]] or 0.0)))
        if "local" in meeting and verdicts[best][2] - verdicts["local"][2] < SLACK_TIE:
            best = "local"
        if best in budgeted:
            return verdict(best, "slo_stall_budget")
        if len(meeting) == len(routes):
            return verdict(best, "slo_most_slack")
        other = next(r for r in routes if r != best)
        reason = "slo_protects_streams" if not verdicts[other][1] else "slo_ttft_target"
        return verdict(best, reason)
    # Goodput counts requests: an arrival late either way loses nothing more by waiting, the
    # streams a local prefill stalls would be lost with it (SmolLM2, goodput_mixed_s39).
    best = min(routes, key=lambda r: (verdicts[r][4], verdicts[r][3],
                                      predicted[index[r]] or 0.0))
    return verdict(best, "slo_least_violation")


def _with_margin(ttft: float, gap: float | None, targets: Targets, streams: int) -> bool:
    """The route's predictions leave ``LOCAL_MARGIN`` of each target set unused. A gap target
    with streams running but no step model to predict their gap is not known to be met."""
    assert LOCAL_MARGIN.ttft_s is not None and LOCAL_MARGIN.itl_s is not None
    if targets.ttft_s is not None and ttft > targets.ttft_s * (1 - LOCAL_MARGIN.ttft_s):
        return False
    if targets.itl_s is None or streams <= 0:
        return True
    return gap is not None and gap <= targets.itl_s * (1 - LOCAL_MARGIN.itl_s)
