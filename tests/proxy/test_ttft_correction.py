"""Each route's TTFT correction factor (``proxy/ttft_correction.py``): learned from the measured
÷ predicted ratio of the requests routed that way, per engine (or pair) and prompt size class,
and applied to that route's prediction."""

from __future__ import annotations

import math
from dataclasses import replace

import httpx
import pytest

from harness.live_proxy import live_proxy, proxy_config
from proxy.costs import RouteCosts
from proxy.policy import CostInputs, RouteInputs, decide, parse_policy, predict
from proxy.ttft_correction import FACTOR_RANGE, RATIO_CLIP, WEIGHT, TtftCorrection, size_class
from tests.proxy.test_queue_estimate import Named
from tests.proxy.test_stall_budget import engine_name
from transport.cost import LinkModel, PrefillModel


def converge(c: TtftCorrection, truth: float, n: int) -> None:
    """``n`` requests whose TTFT is ``truth`` x the uncorrected model's, each predicted with
    the factor of its time (as the proxy routes them)."""
    for _ in range(n):
        c.observe(truth / c.factor)


def test_the_factor_follows_a_steady_ratio_from_one():
    c = TtftCorrection()
    assert c.factor == 1.0 and c.samples == 0
    converge(c, 1.4, 20)
    assert c.factor == pytest.approx(1.4, rel=0.02) and c.samples == 20
    converge(c, 0.8, 20)  # the engine got faster: followed back down
    assert c.factor == pytest.approx(0.8, rel=0.02)


def test_one_request_stalled_by_something_else_moves_it_little():
    c = TtftCorrection()
    converge(c, 1.0, 10)
    c.observe(50.0)  # a request that waited on something no model knows of
    assert c.factor == pytest.approx(RATIO_CLIP ** WEIGHT)  # clipped: at most 1.32x
    c.observe(float("nan"))
    c.observe(0.0)
    c.observe(-1.0)
    assert c.samples == 11


def test_the_factor_stays_in_its_range():
    c = TtftCorrection()
    converge(c, 100.0, 200)
    assert c.factor == pytest.approx(FACTOR_RANGE[1])
    converge(c, 0.001, 400)
    assert c.factor == pytest.approx(FACTOR_RANGE[0])


@pytest.mark.parametrize(("tokens", "same_as"), [
    (1, 1), (127, 64), (128, 511), (512, 2047), (2048, 8191), (0, 1)])
def test_size_classes_are_four_times_wide(tokens, same_as):
    assert size_class(tokens) == size_class(same_as)
    assert size_class(tokens) != size_class(same_as * 4 + 4)


def test_route_costs_keep_one_factor_per_route_place_and_size():
    costs = RouteCosts(kv_bytes_per_token=1000)
    for _ in range(30):
        costs.observe_ttft("local", None, "d", 128, 1.5 / costs.ttft_correction(
            "local", None, "d", 128))
    assert costs.inputs("p", "d", prompt_tokens=128).ttft_correction == pytest.approx(
        (1.0, 1.5), rel=0.02)
    assert costs.inputs("p", "d", prompt_tokens=300).ttft_correction[1] == pytest.approx(
        1.5, rel=0.02)  # the same class
    assert costs.inputs("p", "d", prompt_tokens=1024).ttft_correction == (1.0, 1.0)
    assert costs.inputs("p", "d2", prompt_tokens=128).ttft_correction == (1.0, 1.0)
    assert costs.inputs("p", "d").ttft_correction == (1.0, 1.0)  # size unknown: none
    costs.observe_ttft("disaggregated", "p", "d", 128, 2.0)
    assert costs.ttft_correction("disaggregated", "p", "d", 128) == pytest.approx(
        math.exp(WEIGHT * math.log(2.0)))
    assert costs.ttft_correction("disaggregated", "p2", "d", 128) == 1.0  # another pair
    described = costs.describe()["ttft_correction"]
    assert described["local|d|128+"]["samples"] == 30
    assert described["disaggregated|p->d|128+"]["samples"] == 1


def test_behind_queued_prompt_work_a_route_has_a_factor_of_its_own():
    """A burst's queued requests teach the queued factor; the idle requests after it are
    predicted with the idle one."""
    costs = RouteCosts(kv_bytes_per_token=1000)
    for _ in range(30):  # the burst: every request behind others, 2x its prediction
        costs.observe_ttft("local", None, "d", 128, 2.0 / costs.ttft_correction(
            "local", None, "d", 128, queued=True), queued=True)
    assert costs.inputs("p", "d", prompt_tokens=128).ttft_queued == (False, False)
    assert costs.inputs("p", "d", prompt_tokens=128).ttft_correction == (1.0, 1.0)
    claim = costs.ledger.claim(Named("d"), prompt_tokens=1000)  # prompt work queued there
    try:
        queued = costs.inputs("p", "d", prompt_tokens=128)
        assert queued.ttft_queued == (True, True)
        assert queued.ttft_correction[1] == pytest.approx(2.0, rel=0.02)
        assert queued.ttft_correction[0] == 1.0  # (the disaggregated route's: none learned)
        decision = decide(parse_policy("auto"), RouteInputs(prompt_tokens=128, costs=queued))
        assert decision.ttft_queued == (True, True)  # (what the measurement will correct)
    finally:
        claim.release()
    held = costs.ledger.claim(Named("p"), prompt_tokens=1000)  # on the prefill engine only
    try:
        assert costs.inputs("p", "d", prompt_tokens=128).ttft_queued == (True, False)
    finally:
        held.release()
    assert "local|d|128+|queued" in costs.describe()["ttft_correction"]


def test_each_route_prediction_is_scaled_by_its_factor():
    costs = CostInputs(kv_bytes_per_token=1000,
                       remote_prefill=PrefillModel(fixed_s=0.01, tokens_per_s=1000.0),
                       local_prefill=PrefillModel(fixed_s=0.02, tokens_per_s=500.0),
                       link=LinkModel(fixed_s=0.005, bytes_per_s=1e9), decode_queue_s=0.1)
    inputs = RouteInputs(prompt_tokens=256, costs=costs)
    disagg, local = predict(inputs, costs)
    corrected = CostInputs(**{**vars(costs), "ttft_correction": (2.0, 1.5)})
    assert predict(inputs, corrected) == pytest.approx((2.0 * disagg, 1.5 * local))
    decision = decide(parse_policy("auto"), replace(inputs, costs=corrected))
    assert decision.ttft_correction == (2.0, 1.5)  # (what the decision log shows)
    assert (decision.predicted_disaggregated_s, decision.predicted_local_s) == pytest.approx(
        (2.0 * disagg, 1.5 * local))


async def test_the_proxy_learns_each_local_request_measured_against_its_prediction(
        prefill, decode):
    """A decode engine that takes 150 ms to its first frame: each local request's measured
    TTFT over its prediction moves the factor there (and no other)."""
    decode.decode_first_frame_s = 0.15
    config = proxy_config(prefill, decode, policy="local")
    body = {"model": "m", "prompt": [7] * 200, "max_tokens": 4, "stream": True}
    async with live_proxy(config) as lp, httpx.AsyncClient(timeout=30) as c:
        costs = lp.state.orchestrator.costs
        name = engine_name(lp, decode)
        for _ in range(3):
            r = await c.post(lp.url + "/v1/completions", json=body)
            assert r.status_code == 200 and r.headers["x-pd-route"] == "local"
        assert costs.describe()["ttft_correction"][f"local|{name}|128+"]["samples"] == 3
        assert costs.ttft_correction("local", None, name, 200) > 1.0
        assert costs.ttft_correction("disaggregated", None, name, 200) == 1.0
