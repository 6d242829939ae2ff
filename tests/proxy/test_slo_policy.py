"""``auto`` with latency targets: the arriving request's TTFT and the gaps it would put between
the tokens of the streams decoding on its decode engine, table-driven."""

from __future__ import annotations

import pytest

from proxy.policy import CostInputs, PolicyMode, RouteInputs, Targets, decide, predict_gaps
from proxy.stall_budget import Arrival
from transport.cost import LinkModel, PrefillModel, StepModel

AUTO = PolicyMode("auto")
KVB = 4096
# A decode engine that computes 4,000 prompt tokens/s; its steps cost 5 ms + 0.25 ms per
# prompt token in the step + 0.5 ms per stream (a 1,000-token chunk: 255 ms beside them).
STEP = StepModel(fixed_s=0.005, prefill_s=0.00025, stream_s=0.0005, kv_in_s=0.00001)


def costs(link_fixed_s: float = 0.02, prefill_queue_s: float = 0.0, step=STEP,
          chunk: int = 512, decode_queue_s: float = 0.0) -> CostInputs:
    return CostInputs(
        kv_bytes_per_token=KVB,
        remote_prefill=PrefillModel(fixed_s=0.01, tokens_per_s=4000),
        local_prefill=PrefillModel(fixed_s=0.01, tokens_per_s=4000),
        link=LinkModel(fixed_s=link_fixed_s, bytes_per_s=1e9),
        prefill_queue_s=prefill_queue_s, decode_queue_s=decode_queue_s, decode_step=step,
        chunk_tokens=chunk)


T = Targets(ttft_s=1.0, itl_s=0.05)

# (name, inputs, expected route, expected reason)
CASES = [
    ("no targets: today's rule, local is faster",
     RouteInputs(1000, costs=costs(), streams=4), "local", "recompute_cheaper"),
    ("empty targets: today's rule",
     RouteInputs(1000, costs=costs(), streams=4, targets=Targets()), "local",
     "recompute_cheaper"),
    ("streams decoding: a local prefill would stall them, disaggregate",
     RouteInputs(1000, costs=costs(), streams=4, targets=T), "disaggregated",
     "slo_protects_streams"),
    ("no streams running: local meets both targets with margin: taken",
     RouteInputs(1000, costs=costs(), streams=0, targets=T), "local", "slo_local_fits"),
    ("a short prompt beside streams: its local step (27 ms) fits the 50 ms gap target with "
     "margin: deflected onto the decode engine, though the KV-in step would leave more slack",
     RouteInputs(80, costs=costs(), streams=4, targets=T), "local", "slo_local_fits"),
    ("a prompt whose local step (42 ms) meets the gap target within the margin only: the "
     "route with the most slack, disaggregated",
     RouteInputs(140, costs=costs(), streams=4, targets=T), "disaggregated",
     "slo_most_slack"),
    ("gap target alone, a short prompt while the decode engine computes 4 s of prompts: "
     "prefilled elsewhere, its KV still waits for them there (4.02 s against 4.05 s local): "
     "a tie, local",
     RouteInputs(140, costs=costs(decode_queue_s=4.0), streams=4, targets=Targets(itl_s=0.05)),
     "local", "slo_fastest"),
    ("a short prompt, the link slow to start: local",
     RouteInputs(80, costs=costs(link_fixed_s=0.9), streams=4, targets=T), "local",
     "slo_local_fits"),
    ("fully cached on decode: nothing to prefill, local",
     RouteInputs(1000, decode_cached_tokens=1000, costs=costs(), streams=4, targets=T),
     "local", "slo_local_fits"),
    ("no prefill engine: local whatever the targets",
     RouteInputs(1000, prefill_available=False, costs=costs(), streams=4, targets=T), "local",
     "prefill_unavailable"),
    ("TTFT target only: local meets it with margin",
     RouteInputs(1000, costs=costs(), streams=4, targets=Targets(ttft_s=1.0)), "local",
     "slo_local_fits"),
    ("a congested prefill engine misses the TTFT target; local meets it, within the margin",
     RouteInputs(1000, costs=costs(prefill_queue_s=2.0), streams=4,
                 targets=Targets(ttft_s=0.28)), "local", "slo_ttft_target"),
    ("both miss: the streams' violation outweighs one arrival's",
     RouteInputs(1000, costs=costs(prefill_queue_s=2.0), streams=4, targets=T),
     "disaggregated", "slo_least_violation"),
    ("both miss with one stream: the arrival's TTFT violation weighs more",
     RouteInputs(1000, costs=costs(prefill_queue_s=20.0), streams=1, targets=T),
     "local", "slo_least_violation"),
    ("both miss the arrival's TTFT target (2.3 s local, 4.3 s disaggregated, against 1 s) and "
     "local also stalls its one stream over the gap target: disaggregated, one request late "
     "instead of two, though local's overshoot is the smaller",
     RouteInputs(1000, costs=costs(prefill_queue_s=4.0, decode_queue_s=2.0), streams=1,
                 targets=T), "disaggregated", "slo_least_violation"),
    ("both miss the TTFT target and neither stalls a stream over the gap target: the smaller "
     "overshoot, local",
     RouteInputs(1000, costs=costs(prefill_queue_s=4.0, decode_queue_s=2.0), streams=0,
                 targets=T), "local", "slo_least_violation"),
    ("no step model yet, streams running: their gap unknown, so local is not known to fit; "
     "TTFT slack decides",
     RouteInputs(1000, costs=costs(step=None), streams=4, targets=T), "local",
     "slo_most_slack"),
    ("no step model yet, no streams: nothing to stall, local fits",
     RouteInputs(1000, costs=costs(step=None), streams=0, targets=T), "local",
     "slo_local_fits"),
    ("gap target only, both routes meet it: the faster, local (a short prompt whose local "
     "step, 42 ms, is within the margin only)",
     RouteInputs(140, costs=costs(), streams=4, targets=Targets(itl_s=0.05)), "local",
     "slo_fastest"),
    ("gap target only, both meet it, the prefill engine holds most of the prompt: the faster, "
     "disaggregated",
     RouteInputs(1000, prefill_cached_tokens=900, costs=costs(link_fixed_s=0.0), streams=4,
                 targets=Targets(itl_s=0.16)), "disaggregated", "slo_fastest"),
    ("gap target only, the local prefill's step misses it: disaggregated, whatever its TTFT",
     RouteInputs(1000, costs=costs(prefill_queue_s=2.0), streams=4,
                 targets=Targets(itl_s=0.05)), "disaggregated", "slo_protects_streams"),
    ("cached on the prefill engine, local within the TTFT margin only: the most slack",
     RouteInputs(1000, prefill_cached_tokens=800, costs=costs(step=None, link_fixed_s=0.0),
                 streams=4, targets=Targets(ttft_s=0.27)), "disaggregated", "slo_most_slack"),
]


# The streams' stall budget (each stream's p99 gap is the target).
BUDGET_CASES = [
    ("gap target alone, a local prefill's step over it, every stream with a stall to spare: "
     "local, the faster",
     RouteInputs(1000, costs=costs(prefill_queue_s=2.0), streams=4,
                 targets=Targets(itl_s=0.05), stall_room=2), "local", "slo_stall_budget"),
    ("the same with no stall to spare: disaggregated (as without a budget)",
     RouteInputs(1000, costs=costs(prefill_queue_s=2.0), streams=4,
                 targets=Targets(itl_s=0.05), stall_room=0), "disaggregated",
     "slo_protects_streams"),
    ("a prompt of 4 chunks (4 stalls) and room for 2: disaggregated",
     RouteInputs(2000, costs=costs(prefill_queue_s=2.0), streams=4,
                 targets=Targets(itl_s=0.05), stall_room=2), "disaggregated",
     "slo_protects_streams"),
    ("both targets, disaggregated meets both with slack: not worth a stall (local, within the "
     "budget, has no gap slack)",
     RouteInputs(1000, costs=costs(), streams=4, targets=T, stall_room=2), "disaggregated",
     "slo_most_slack"),
    ("both targets, the prefill engine congested past the TTFT target: local spends its two "
     "chunks' stalls",
     RouteInputs(1000, costs=costs(prefill_queue_s=2.0), streams=4, targets=T, stall_room=2),
     "local", "slo_stall_budget"),
    ("the same with room for one stall of the two: both miss, the least violation",
     RouteInputs(1000, costs=costs(prefill_queue_s=2.0), streams=4, targets=T, stall_room=1),
     "disaggregated", "slo_least_violation"),
    ("within the target anyway: the budget is not touched",
     RouteInputs(80, costs=costs(), streams=4, targets=T, stall_room=2), "local",
     "slo_local_fits"),
    ("gap target alone, a local step (42 ms) under the 50 ms target by less than the fit's "
     "error, room to spare: local, its stall held against the budget",
     RouteInputs(140, costs=costs(decode_queue_s=4.0), streams=4, targets=Targets(itl_s=0.05),
                 stall_room=2), "local", "slo_stall_budget"),
    ("the same with no room: local as predicted to meet it (nothing to hold)",
     RouteInputs(140, costs=costs(decode_queue_s=4.0), streams=4, targets=Targets(itl_s=0.05),
                 stall_room=0), "local", "slo_fastest"),
]


@pytest.mark.parametrize(("inputs", "route", "reason"),
                         [c[1:] for c in CASES + BUDGET_CASES],
                         ids=[c[0] for c in CASES + BUDGET_CASES])
def test_decision(inputs, route, reason):
    d = decide(AUTO, inputs)
    assert (d.route, d.reason) == (route, reason)


def test_gaps_predicted_per_route():
    inputs = RouteInputs(1000, costs=costs(chunk=512), streams=4, targets=T)
    disagg, local = predict_gaps(inputs, inputs.costs)
    assert local == pytest.approx(STEP.seconds(512, 4))  # the largest chunk beside them
    assert disagg == pytest.approx(STEP.seconds(0, 4, kv_tokens=1000))
    d = decide(AUTO, inputs)
    assert d.predicted_gap_s() == d.gap_disaggregated_s
    assert predict_gaps(RouteInputs(1000, costs=costs(), streams=0), costs()) == (None, None)


def test_the_streams_decoding_beside_a_local_prefill_lengthen_its_ttft():
    alone = decide(AUTO, RouteInputs(2000, costs=costs(chunk=512), streams=0))
    busy = decide(AUTO, RouteInputs(2000, costs=costs(chunk=512), streams=8))
    # Half the 9 ms step in flight (5 ms + 8 x 0.5 ms), then 4 chunks, each step also
    # decoding the 8 streams: 4 x 8 x 0.5 ms.
    assert busy.predicted_local_s - alone.predicted_local_s == pytest.approx(0.0045 + 0.016)
    assert busy.predicted_disaggregated_s == alone.predicted_disaggregated_s


@pytest.mark.parametrize("streams", [1, 6])
def test_a_local_prompt_beside_streams_waits_for_half_the_step_in_flight(streams):
    """The local prefill model is timed alone. Beside streams a prompt first waits for the
    step they are in: 64-token prompts on tiny took 4.6 ms more beside one stream, 11 ms
    beside six, where the fit alone predicted them to the millisecond."""
    alone = decide(AUTO, RouteInputs(64, costs=costs(), streams=0))
    busy = decide(AUTO, RouteInputs(64, costs=costs(), streams=streams))
    in_flight = STEP.seconds(0, streams)
    assert busy.predicted_local_s - alone.predicted_local_s == pytest.approx(
        0.5 * in_flight + STEP.stream_s * streams)
    # Only streams decoding now are in that step. One due to start decoding first is decoded
    # beside the prompt's chunk, but no step of it is in flight yet.
    due = decide(AUTO, RouteInputs(64, costs=costs(), streams=0,
                                   arriving=(Arrival(in_s=0.001, room=5),)))
    assert due.predicted_local_s - alone.predicted_local_s == pytest.approx(STEP.stream_s)


def test_slacks_within_the_tie_margin_go_local():
    # Local (105 ms) meets a 115 ms target, but within LOCAL_MARGIN; disaggregated (100 ms)
    # has 4 % more of the target to spare: not worth moving the KV for.
    near = CostInputs(KVB, PrefillModel(0.0, 4000), PrefillModel(0.0, 4000 * 0.95),
                      LinkModel(0.0, 1e18), decode_step=STEP)
    d = decide(AUTO, RouteInputs(400, costs=near, streams=0, targets=Targets(ttft_s=0.115)))
    assert d.predicted_disaggregated_s < d.predicted_local_s
    assert (d.route, d.reason) == ("local", "slo_most_slack")


def test_ties_go_to_the_faster_route_then_local():
    equal = CostInputs(KVB, PrefillModel(0.0, 4000), PrefillModel(0.0, 4000),
                       LinkModel(0.0, 1e18), decode_step=STEP)
    d = decide(AUTO, RouteInputs(100, costs=equal, streams=0, targets=Targets(ttft_s=0.027)))
    assert (d.route, d.reason) == ("local", "slo_most_slack")


def test_local_is_taken_only_with_the_margin_to_spare():
    """Either side of the margin: a local gap just under 75 % of the target is taken, one just
    over it goes to the most slack (disaggregated: its KV-in step is shorter)."""
    from proxy.policy import LOCAL_MARGIN

    step = StepModel(fixed_s=0.0, prefill_s=0.0001, stream_s=0.0, kv_in_s=0.0)
    c = costs(step=step, chunk=4096)
    targets = Targets(ttft_s=1.0, itl_s=0.04)
    edge = round(targets.itl_s * (1 - LOCAL_MARGIN.itl_s) / step.prefill_s)  # 300 tokens: 30 ms
    d = decide(AUTO, RouteInputs(edge - 5, costs=c, streams=2, targets=targets))
    assert d.gap_local_s == pytest.approx(0.0295)
    assert (d.route, d.reason) == ("local", "slo_local_fits")
    d = decide(AUTO, RouteInputs(edge + 5, costs=c, streams=2, targets=targets))
    assert (d.route, d.reason) == ("disaggregated", "slo_most_slack")


def test_with_a_gap_target_alone_the_faster_route_that_meets_it_wins_local_on_a_tie():
    """Past the margin, with no TTFT target: the faster route; local when within SLACK_TIE."""
    from proxy.policy import SLACK_TIE

    step = StepModel(fixed_s=0.0, prefill_s=0.0001, stream_s=0.0, kv_in_s=0.0)
    gap_only = Targets(itl_s=0.04)
    d = decide(AUTO, RouteInputs(305, costs=costs(step=step, chunk=4096), streams=2,
                                 targets=gap_only))
    assert d.predicted_local_s < d.predicted_disaggregated_s
    assert (d.route, d.reason) == ("local", "slo_fastest")
    # Local a little slower than disaggregated: taken within SLACK_TIE, not past it.
    for slower, route in ((1 + SLACK_TIE / 2, "local"), (1 + 2 * SLACK_TIE, "disaggregated")):
        c = CostInputs(KVB, PrefillModel(0.0, 4000), PrefillModel(0.0, 4000 / slower),
                       LinkModel(0.0, 1e18), decode_step=step, chunk_tokens=4096)
        d = decide(AUTO, RouteInputs(305, costs=c, streams=2, targets=gap_only))
        assert d.predicted_local_s == pytest.approx(d.predicted_disaggregated_s * slower)
        assert (d.route, d.reason) == (route, "slo_fastest")


# --- the streams' stall budget (each stream's p99 gap is the target) --------------------------

def nearest_rank_p99(values: list[float]) -> float:
    """The goodput benchmark's p99 (``benchmarks/goodput.p99``), written again here."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, -(-99 * len(xs) // 100) - 1)]


@pytest.mark.parametrize("gaps", [1, 2, 15, 99, 100, 101, 199, 200, 255, 1000, 4095])
def test_the_stall_allowance_is_what_the_p99_gap_tolerates(gaps):
    from proxy.stall_budget import stall_allowance

    n = stall_allowance(gaps)
    assert nearest_rank_p99([1.0] * (gaps - n) + [9.0] * n) == 1.0
    assert nearest_rank_p99([1.0] * (gaps - n - 1) + [9.0] * (n + 1)) == 9.0
    assert (stall_allowance(255), stall_allowance(99), stall_allowance(0)) == (2, 0, 0)





def test_a_budgeted_route_says_how_many_stalls_it_spends():
    spent = decide(AUTO, RouteInputs(1000, costs=costs(prefill_queue_s=2.0), streams=4,
                                     targets=Targets(itl_s=0.05), stall_room=2))
    assert (spent.reason, spent.stalls) == ("slo_stall_budget", 2)  # two chunks of 512
    within = decide(AUTO, RouteInputs(80, costs=costs(), streams=4, targets=T, stall_room=2))
    assert (within.reason, within.stalls) == ("slo_local_fits", 0)
    near = decide(AUTO, RouteInputs(140, costs=costs(decode_queue_s=4.0), streams=4,
                                    targets=Targets(itl_s=0.05), stall_room=2))
    assert (near.route, near.reason, near.stalls) == ("local", "slo_stall_budget", 1)


def test_a_short_local_prefill_does_not_stall_streams_that_start_after_it():
    """Two long prompts bound to the decode engine are still prefilled on the prefill engine
    (their first tokens due in 3 s and 7 s), with no stall room. A 64-token arrival's local
    prefill (26 ms) ends before either starts decoding: it stalls nobody, and it is taken
    (prefilled elsewhere, it would wait 4 s behind them: the SmolLM2 mixed run's misses).
    The same arrivals due within its local prefill are stalled by it: disaggregated."""
    from proxy.stall_budget import Arrival

    busy_prefill = costs(prefill_queue_s=4.0)
    later = (Arrival(3.0, 0), Arrival(7.0, 0))
    d = decide(AUTO, RouteInputs(64, costs=busy_prefill, targets=Targets(itl_s=0.01),
                                 arriving=later))
    assert (d.route, d.reason, d.streams) == ("local", "slo_local_fits", 0)
    assert d.gap_local_s is None  # no stream decodes beside it
    # A disaggregated route's KV-in step (after 4 s) comes after the first of them starts.
    assert d.gap_disaggregated_s == pytest.approx(STEP.seconds(0, 1, kv_tokens=64))

    soon = (Arrival(0.005, 0), Arrival(7.0, 0))
    d = decide(AUTO, RouteInputs(64, costs=busy_prefill, targets=Targets(itl_s=0.01),
                                 arriving=soon))
    assert (d.route, d.reason, d.streams) == ("disaggregated", "slo_protects_streams", 1)
    # Counted as decoding now (what the proxy did before), the far ones protect nothing real.
    d = decide(AUTO, RouteInputs(64, costs=busy_prefill, targets=Targets(itl_s=0.01),
                                 streams=2))
    assert d.route == "disaggregated"


def test_the_exposed_streams_room_is_the_fewest_among_them():
    from proxy.stall_budget import Arrival, exposed

    arriving = (Arrival(0.1, 1), Arrival(5.0, 0))
    assert exposed(0, 0, arriving, 1.0) == (1, 1)  # the 5 s one starts after the steps end
    assert exposed(2, 3, arriving, 1.0) == (3, 1)
    assert exposed(2, 3, arriving, None) == (4, 0)  # None: every arrival
    assert exposed(0, 0, (), 1.0) == (0, 0)  # nobody: no room, no streams
