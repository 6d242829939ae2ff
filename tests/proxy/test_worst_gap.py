"""The worst gap an arrival puts in the streams, per route: fitted from the arrivals the
tracker measured, and what the decision predicts with it."""

from __future__ import annotations

import random

import pytest

from proxy.costs import RouteCosts
from proxy.policy import CostInputs, RouteInputs, predict_gaps
from proxy.step_tracker import KEEP_DONE_S, StepTracker
from proxy.worst_gap import WorstGapFit
from transport.cost import LinkModel, PrefillModel, StepModel


def recorded(seed: int = 0) -> list[tuple[int, float]]:
    """Hand-overs of 32-1,023 tokens whose worst gap beside the streams is 8 ms over a plain
    step plus 5 us a token, with a few ms of jitter (the worst of many noisy steps), and one
    hand-over stalled 180 ms by something else."""
    rng = random.Random(seed)
    rows = [(n, 0.008 + 5e-6 * n + rng.uniform(-0.002, 0.002))
            for n in [32, 64, 128, 256, 512, 768, 1023] * 4]
    rng.shuffle(rows)
    rows.insert(7, (32, 0.180))
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_fits_the_excess_of_the_worst_gap_and_drops_an_outlier(seed):
    fit = WorstGapFit()
    for tokens, excess in recorded(seed):
        fit.observe(tokens, excess)
    assert fit.fitted is not None
    fixed, per_token = fit.fitted
    assert fixed == pytest.approx(0.008, abs=0.0015)
    assert per_token == pytest.approx(5e-6, rel=0.3)


def test_too_few_hand_overs_fit_nothing_and_one_size_fits_no_slope():
    fit = WorstGapFit()
    for _ in range(WorstGapFit.MIN_SAMPLES - 1):
        fit.observe(1023, 0.010)
    assert fit.fitted is None
    fit.observe(1023, 0.012)
    assert fit.fitted is not None
    fixed, per_token = fit.fitted
    assert per_token == 0.0 and 0.010 < fixed < 0.012  # the sizes never varied: a mean
    fit.observe(0, 5.0)  # no KV moved: not a hand-over
    assert fit.n_samples == WorstGapFit.MIN_SAMPLES


def test_the_tracker_reports_each_hand_over_with_its_streams_and_worst_gap():
    handovers: list[tuple[str, int, int, float]] = []
    t = StepTracker(lambda *s: None, None, lambda *h: handovers.append(h))
    a, b = object(), object()
    t.stream_started(a, 0.0)
    t.stream_started(b, 0.0)
    t.work_started("kv", 0.005, route="disaggregated")
    t.work_started("local", 0.056, route="local")
    for ts in (0.01, 0.02, 0.045, 0.055):  # the 25 ms gap is the step that took the KV in
        t.frame(a, ts)
    t.work_done("kv", 0.05, kv_tokens=900)
    t.frame(a, 0.065)
    t.work_done("local", 0.06, prefill_tokens=64)
    t.frame(a, 0.05 + KEEP_DONE_S + 1)
    # The local prefill's worst gap is the one that carried its chunk (10 ms).
    assert handovers == [("disaggregated", 900, 2, pytest.approx(0.025)),
                         ("local", 64, 2, pytest.approx(0.010))]


@pytest.mark.parametrize("first, second, frames, done", [
    # a hand-over whose worst gap (125 ms) also computed a 512-token local prompt
    (("kv", 0.005, "disaggregated"), ("local", 0.015, "local"), (0.01, 0.02, 0.145, 0.155),
     [("local", 0.145, {"prefill_tokens": 512}), ("kv", 0.15, {"kv_tokens": 900})]),
    # a local prefill whose worst gap (40 ms) also took 900 tokens of KV in
    (("local", 0.005, "local"), ("kv", 0.015, "disaggregated"), (0.01, 0.02, 0.06, 0.07),
     [("kv", 0.055, {"kv_tokens": 900}), ("local", 0.065, {"prefill_tokens": 16})]),
], ids=["hand_over_beside_local_prefill", "local_prefill_beside_hand_over"])
def test_a_worst_gap_that_carried_the_other_routes_work_is_reported_for_neither(
        first, second, frames, done):
    handovers: list[tuple[str, int, int, float]] = []
    t = StepTracker(lambda *s: None, None, lambda *h: handovers.append(h))
    a = object()
    t.stream_started(a, 0.0)
    for kind, ts, route in (first, second):
        t.work_started(kind, ts, route=route)
    for ts in frames:
        t.frame(a, ts)
    for kind, ts, sizes in done:
        t.work_done(kind, ts, **sizes)
    t.frame(a, frames[-1] + KEEP_DONE_S + 1)
    assert handovers == []


def test_route_costs_predict_the_hand_over_gap_from_the_hand_overs_measured():
    """Fed through the tracker as the relay does, 1,000-token hand-overs whose worst gap was
    30 ms beside 10 ms steps: the disaggregated route's predicted gap is 30 ms, where the step
    fit's KV term on one step (here 50 us a token, spread over the hand-over's steps) says
    60 ms."""
    costs = RouteCosts(kv_bytes_per_token=4096)
    tracker = costs.tracker("d")
    s = object()
    tracker.stream_started(s, 0.0)
    now = 0.0
    for i in range(WorstGapFit.MIN_SAMPLES):
        tracker.work_started(i, now, route="disaggregated")
        for gap in (0.010, 0.030, 0.010):
            now += gap
            tracker.frame(s, now)
        tracker.work_done(i, now, kv_tokens=1000)
        for _ in range(int(KEEP_DONE_S / 0.010) + 10):  # plain steps until it is reported
            now += 0.010
            tracker.frame(s, now)
    step = costs.step_model("d")
    assert step.handover_fixed_s is not None and step.local_fixed_s == 0.0
    spread = StepModel(fixed_s=step.fixed_s, prefill_s=0.0, stream_s=step.stream_s,
                       kv_in_s=50e-6)
    inputs = RouteInputs(prompt_tokens=1000, streams=1, costs=_costs(spread))
    assert predict_gaps(inputs, inputs.costs)[0] == pytest.approx(spread.seconds(0, 1, 1000))
    fitted = _costs(step)
    assert predict_gaps(RouteInputs(prompt_tokens=1000, streams=1, costs=fitted), fitted)[0] == (
        pytest.approx(0.030, abs=0.003))


def _costs(step: StepModel) -> CostInputs:
    prefill = PrefillModel(fixed_s=0.01, tokens_per_s=10_000.0)
    return CostInputs(4096, prefill, prefill, LinkModel(fixed_s=0.01, bytes_per_s=1e9),
                      decode_step=step)


def test_route_costs_add_a_local_prefills_worst_gap_excess():
    """64-token local prefills beside a stream, the steps 10 ms and the one carrying the chunk
    always 6 ms longer than the step fit prices it (the worst of a window, not a mean): the
    local route's predicted gap takes the excess on."""
    costs = RouteCosts(kv_bytes_per_token=4096)
    tracker = costs.tracker("d")
    s = object()
    tracker.stream_started(s, 0.0)
    now = 0.0
    for i in range(WorstGapFit.MIN_SAMPLES):
        tracker.work_started(i, now, route="local")
        plain = costs.step_model("d").seconds(64, 1)
        for gap in (0.010, plain + 0.006):
            now += gap
            tracker.frame(s, now)
        tracker.work_done(i, now, prefill_tokens=64)
        for _ in range(int(KEEP_DONE_S / 0.010) + 10):
            now += 0.010
            tracker.frame(s, now)
    step = costs.step_model("d")
    assert step.local_fixed_s == pytest.approx(0.006, abs=0.002)
    inputs = RouteInputs(prompt_tokens=64, streams=1, costs=_costs(step))
    assert predict_gaps(inputs, inputs.costs)[1] == pytest.approx(
        step.seconds(64, 1) + step.local_fixed_s)
