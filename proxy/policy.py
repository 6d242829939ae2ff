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
reason ``slo_stall_budget``; one under it by less than the fits' error spends them too.

Where the prefill engine decodes too (the one-pool layout, an engine serving both roles), a
disaggregated route's prefill stalls the streams there for its chunks, as a local prefill
stalls the decode engine's: both are weighed (``RouteInputs.prefill_streams``).

The inputs and the answer: ``proxy/route_inputs.py``; the predictions:
``proxy/route_predict.py``; the targets rule: ``proxy/slo_rule.py``. No clock, no I/O.
"""

from __future__ import annotations

from dataclasses import replace

from proxy.policy_mode import PolicyMode, parse_policy
from proxy.route_inputs import CostInputs, Decision, Route, RouteInputs, Targets, exposure
from proxy.route_predict import predict, predict_gaps, predict_prefill_gap
from proxy.slo_rule import LOCAL_MARGIN, SLACK_TIE, for_targets
from proxy.stall_budget import stalls_needed

__all__ = ["LOCAL_MARGIN", "SLACK_TIE", "CostInputs", "Decision", "PolicyMode", "RouteInputs",
           "Targets", "decide", "parse_policy", "predict", "predict_gaps"]


def decide(mode: PolicyMode, inputs: RouteInputs) -> Decision:
    predicted: tuple[float | None, float | None] = (None, None)
    gaps: tuple[float | None, float | None] = (None, None)
    prefill_gap = None
    correction, queued = (1.0, 1.0), (False, False)
    if inputs.costs is not None:
        correction, queued = inputs.costs.ttft_correction, inputs.costs.ttft_queued
        predicted = predict(inputs, inputs.costs)
        gaps = predict_gaps(inputs, inputs.costs, predicted)
        prefill_gap = predict_prefill_gap(inputs, inputs.costs)

    def made(route: Route, reason: str) -> Decision:
        ttft = predicted[0] if route == "disaggregated" else predicted[1]
        streams, room = exposure(inputs, ttft)
        return Decision(route, reason, *predicted, *gaps, room, streams=streams,
                        gap_prefill_s=prefill_gap, ttft_correction=correction,
                        ttft_queued=queued)

    uncached = max(0, inputs.prompt_tokens - inputs.decode_cached_tokens)
    judge = inputs.costs is not None and inputs.targets is not None and inputs.targets.any

    def judged(reason: str | None = None) -> Decision:
        """The targets rule's route (``reason`` given: local, judged all the same, so that
        the pair choice weighs what it costs the streams there)."""
        assert inputs.costs is not None and inputs.targets is not None
        v = for_targets(inputs, inputs.targets, predicted, gaps, prefill_gap)
        spent = stalls_needed(v.route, uncached, inputs.costs.chunk_tokens)
        return replace(made(v.route, reason or v.reason),
                       stalls=spent if v.spends_budget else 0,
                       over_targets=v.over_targets, violation=v.violation)

    if not inputs.prefill_available:
        return judged("prefill_unavailable") if judge and mode.kind == "auto" else made(
            "local", "prefill_unavailable")
    if mode.kind == "local":
        return made("local", "policy_local")
    if mode.kind == "disaggregate":
        return made("disaggregated", "policy_disaggregate")
    if mode.kind == "threshold":
        over = uncached >= mode.threshold_tokens
        return made("disaggregated", "over_threshold") if over else made("local", "under_threshold")
    # auto
    if inputs.costs is None:
        return made("disaggregated", "no_cost_model")
    if judge:
        return judged()
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
