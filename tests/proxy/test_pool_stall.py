"""An engine of the one pool prefills for another while streams decode on it: a disaggregated
route's prefill stalls those streams as a local prefill stalls the decode engine's, and the
targets rule weighs both (issue 16: "with layouts where an engine may serve both roles")."""

from __future__ import annotations

import pytest

from proxy.policy import CostInputs, PolicyMode, RouteInputs, Targets, decide, predict
from proxy.route_predict import predict_prefill_gap
from tests.proxy.test_routing import Named, request
from transport.cost import LinkModel, PrefillModel, StepModel

AUTO = PolicyMode("auto")
# Steps of 5 ms + 0.25 ms a prompt token + 0.5 ms a stream: a 1,000-token prompt in 512-token
# chunks puts a 133 ms step in the streams beside it, on either engine.
STEP = StepModel(fixed_s=0.005, prefill_s=0.00025, stream_s=0.0005, kv_in_s=0.00001)
T = Targets(ttft_s=2.0, itl_s=0.05)


def costs(prefill_step: StepModel | None = STEP) -> CostInputs:
    model = PrefillModel(fixed_s=0.01, tokens_per_s=4000)
    return CostInputs(kv_bytes_per_token=4096, remote_prefill=model, local_prefill=model,
                      link=LinkModel(fixed_s=0.02, bytes_per_s=1e9), decode_step=STEP,
                      chunk_tokens=512, prefill_step=prefill_step)


# (name, inputs, expected route, expected reason)
CASES = [
    ("no stream on the prefill engine: the decode engine's stream is spared, disaggregated",
     RouteInputs(1000, costs=costs(), streams=1, targets=T),
     "disaggregated", "slo_protects_streams"),
    ("three streams on the prefill engine, one on the decode engine: either route stalls some "
     "over the gap target; local stalls one instead of three",
     RouteInputs(1000, costs=costs(), streams=1, targets=T, prefill_streams=3),
     "local", "slo_least_violation"),
    ("one stream on each: a tie in requests over the targets and in violation, the faster "
     "route (local: no hand-over)",
     RouteInputs(1000, costs=costs(), streams=1, targets=T, prefill_streams=1),
     "local", "slo_least_violation"),
    ("the prompt cached on the prefill engine: nothing computed there, its streams not stalled",
     RouteInputs(1000, prefill_cached_tokens=1000, costs=costs(), streams=1, targets=T,
                 prefill_streams=3), "disaggregated", "slo_protects_streams"),
    ("a short prompt: its step on the prefill engine (27 ms) is under the gap target; the "
     "decode engine's streams keep their slack too, local fits with margin",
     RouteInputs(80, costs=costs(), streams=4, targets=T, prefill_streams=3),
     "local", "slo_local_fits"),
    ("a prompt whose step (42 ms) meets the gap target within the margin only, no stream on "
     "the prefill engine: the most slack, disaggregated",
     RouteInputs(140, costs=costs(), streams=4, targets=T), "disaggregated", "slo_most_slack"),
    ("the same with a stream on the prefill engine: its 41 ms step there leaves the route "
     "as little slack as local's, a tie, local",
     RouteInputs(140, costs=costs(), streams=4, targets=T, prefill_streams=1),
     "local", "slo_most_slack"),
    ("no step model for the prefill engine: its stall is not known, and not counted",
     RouteInputs(1000, costs=costs(prefill_step=None), streams=1, targets=T,
                 prefill_streams=3), "disaggregated", "slo_protects_streams"),
    ("no targets: today's rule",
     RouteInputs(1000, costs=costs(), streams=1, prefill_streams=3), "local",
     "recompute_cheaper"),
]


@pytest.mark.parametrize("name,inputs,route,reason", CASES, ids=[c[0][:60] for c in CASES])
def test_decision(name, inputs, route, reason):
    d = decide(AUTO, inputs)
    assert (d.route, d.reason) == (route, reason), name


def test_the_prefill_engines_stall_is_its_largest_chunks_step():
    inputs = RouteInputs(1000, costs=costs(), streams=1, targets=T, prefill_streams=3)
    assert predict_prefill_gap(inputs, costs()) == pytest.approx(STEP.local_gap(1000, 512, 3))
    assert decide(AUTO, inputs).gap_prefill_s == pytest.approx(0.005 + 0.128 + 0.0015)
    for quiet in (RouteInputs(1000, costs=costs(), streams=1, targets=T),
                  RouteInputs(1000, prefill_cached_tokens=1000, costs=costs(), prefill_streams=3),
                  RouteInputs(1000, prefill_available=False, costs=costs(), prefill_streams=3)):
        assert predict_prefill_gap(quiet, costs()) is None


def test_streams_on_the_prefill_engine_lengthen_the_disaggregated_ttft():
    """Its fit is timed alone: each chunk's step decodes them too, and the prompt waits for the
    step in flight (as a local prompt beside streams does)."""
    alone, _ = predict(RouteInputs(1000), costs())
    beside, _ = predict(RouteInputs(1000, prefill_streams=3), costs())
    assert beside - alone == pytest.approx(0.5 * STEP.seconds(0, 3) + 2 * 0.0005 * 3)


async def test_the_plan_counts_the_streams_decoding_on_a_pool_prefill_engine():
    """Two engines of one pool: the one picked to prefill has requests decoding on it. The plan
    tells the policy, which keeps the prompt where it decodes rather than stall them."""
    pool, costs_, orch = pool_setup()
    orch.policy = AUTO
    orch.targets = Targets(ttft_s=10.0, itl_s=0.05)
    e0, e1 = pool.all()
    long = request(prompt=list(range(100, 500)))  # 400 tokens: one ~0.2 s step at the prior
    _, stream = await planned_on(orch, e1)  # a stream on e1, the decode engine
    spared = (await orch.plan(long, prefill=e0, decode=e1)).decision
    assert (spared.route, spared.reason) == ("disaggregated", "slo_protects_streams")
    assert spared.gap_prefill_s is None
    on_prefill = [(await planned_on(orch, e0))[1] for _ in range(2)]
    both = (await orch.plan(long, prefill=e0, decode=e1)).decision
    assert both.gap_prefill_s is not None and both.gap_prefill_s > 0.05
    assert (both.route, both.reason) == ("local", "slo_least_violation")
    for claim in on_prefill + [stream]:
        claim.release()


def pool_setup():
    from proxy.costs import RouteCosts
    from proxy.deadlines import Deadlines
    from proxy.metrics import ProxyMetrics
    from proxy.orchestrator import Orchestrator
    from proxy.pool import EnginePool
    from tests.proxy.test_routing import Ids

    pool = EnginePool([], [], ProxyMetrics(), both=[Named("e0"), Named("e1")])
    for e in pool.all():
        e.healthy = True
    costs_ = RouteCosts(kv_bytes_per_token=1000)
    return pool, costs_, Orchestrator(pool, AUTO, Deadlines(), ProxyMetrics(), costs_,
                                      prompts=Ids())


async def planned_on(orch, engine):
    """A request decoding on ``engine`` (its output budget claimed there)."""
    plan = await orch.plan(request(), decode=engine)
    return plan, orch.ledger.claim(engine, output_tokens=plan.output_budget)


async def test_a_prefill_on_a_pool_engine_is_timed_on_the_streams_there(prefill):
    """The prefill leg tells the prefill engine's step tracker: the gaps its streams had meanwhile
    carry the prompt's tokens (the step fit), and the worst is reported beside the predicted
    gap, as ``pd_itl_prediction_ratio{route="prefill"}``."""
    import asyncio
    import time

    from proxy.costs import RouteCosts
    from proxy.deadlines import Deadlines
    from proxy.engine_client import EngineClient, new_session
    from proxy.ledger import Ledger
    from proxy.metrics import ProxyMetrics
    from proxy.plan import Plan
    from proxy.policy import Decision
    from proxy.pool import EnginePool
    from proxy.prefill_leg import PrefillLeg
    from proxy.requests import ApiRequest
    from proxy.step_tracker import KEEP_DONE_S
    from proxy.trace import Trace

    arrivals = []
    costs_ = RouteCosts(1000, on_arrival=lambda *a: arrivals.append(a))
    pool = EnginePool([], [], ProxyMetrics(), both=[EngineClient("e0", prefill.url,
                                                                 new_session())])
    (e0,) = pool.all()
    e0.healthy = True
    tracker = costs_.tracker("e0")
    stream = object()
    tracker.stream_started(stream, time.perf_counter())
    prefill.prefill_gate = asyncio.Event()
    leg = PrefillLeg(pool, Ledger(), costs_, Deadlines(), ProxyMetrics())
    plan = Plan(Decision("disaggregated", "test", gap_prefill_s=0.1), e0, e0, 64, 64, 0, 16)
    req = ApiRequest("completions", {"model": "m", "prompt": list(range(64)), "max_tokens": 16},
                     False, "r")
    task = asyncio.create_task(leg.run(req, plan, Trace(time.perf_counter())))
    await prefill.wait_for_requests(1)
    await asyncio.sleep(0.05)
    tracker.frame(stream, time.perf_counter())  # a gap while the prompt is computed there
    prefill.prefill_gate.set()
    assert (await task) is not None
    tracker.frame(stream, time.perf_counter())
    assert not arrivals  # (reported once its time for late gaps is over)
    tracker.frame(stream, time.perf_counter() + KEEP_DONE_S + 1)
    assert len(arrivals) == 1
    route, predicted, measured = arrivals[0]
    assert (route, predicted) == ("prefill", 0.1) and measured >= 0.05
