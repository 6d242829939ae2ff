"""Which requests a route's stalls are counted against: the streams decoding on the engine.
Not a prefill leg running there (it streams nothing), not a whole reply (its client sees no gap
between tokens). And a decision whose route is forced (no prefill engine for that decode
engine) still says what it costs those streams, so that the pair choice can weigh it."""

from __future__ import annotations

import asyncio

import httpx

from harness.live_proxy import live_proxy, proxy_config
from proxy.plan import streams_beside_prefill, streams_exposed
from proxy.policy import CostInputs, PolicyMode, RouteInputs, Targets, decide
from proxy.stall_budget import stalls_needed
from tests.proxy.test_pool_stall import planned_on, pool_setup
from tests.proxy.test_routing import request, setup
from transport.cost import LinkModel, PrefillModel, StepModel

AUTO = PolicyMode("auto")
STEP = StepModel(fixed_s=0.005, prefill_s=0.00025, stream_s=0.0005, kv_in_s=0.00001)


def costs(prefill_queue_s: float = 0.0) -> CostInputs:
    m = PrefillModel(fixed_s=0.01, tokens_per_s=4000)
    return CostInputs(4096, m, m, LinkModel(0.02, 1e9), prefill_queue_s=prefill_queue_s,
                      decode_step=STEP, chunk_tokens=512)


async def test_a_prefill_leg_on_an_engine_is_no_stream_there():
    pool, costs_, orch = pool_setup()
    e0, _ = pool.all()
    leg = orch.ledger.claim(e0, prompt_tokens=400)  # e0 prefills for a request on e1
    try:
        assert streams_beside_prefill(costs_, e0, 0.0) == 0
        assert streams_exposed(costs_, e0) == 0
    finally:
        leg.release()


async def test_whole_replies_decoding_are_no_streams_to_protect():
    pool, costs_, orch = setup(prefills=("p0",), decodes=("d0",))
    orch.targets = Targets(ttft_s=10.0, itl_s=0.05)
    d0 = pool.get("d0")
    whole = [orch.ledger.claim(d0, output_tokens=64, stream=False) for _ in range(4)]
    try:
        plan = await orch.plan(request(prompt=list(range(100, 2100))))
        assert plan.decision.streams == 0, plan.decision
        streamed = orch.ledger.claim(d0, output_tokens=64, itl_s=0.05)
        plan = await orch.plan(request(prompt=list(range(100, 2100))))
        assert plan.decision.streams == 1, plan.decision
        streamed.release()
    finally:
        for c in whole:
            c.release()


async def test_the_proxy_claims_a_whole_reply_as_no_stream(prefill, decode):
    """Through the proxy: a whole reply decoding (held at the engine) is on the ledger, and
    not as a stream; a streamed one is."""
    decode.decode_gate = gate = asyncio.Event()
    body = {"model": "m", "prompt": "hello there", "max_tokens": 4,
            "slo": {"itl_ms": 50}}
    async with live_proxy(proxy_config(prefill, decode)) as lp, httpx.AsyncClient() as c:
        ledger = lp.state.orchestrator.ledger
        name = lp.state.pool.decode[0].name
        for stream, expected in ((False, 0), (True, 1)):
            call = asyncio.create_task(c.post(lp.url + "/v1/completions",
                                              json=dict(body, stream=stream), timeout=30))
            while ledger.load(name).requests == 0:
                await asyncio.sleep(0.01)
            assert ledger.bound(name) == expected
            gate.set()
            assert (await call).status_code == 200
            gate.clear()


def test_a_forced_local_route_says_what_it_costs_the_streams():
    """No prefill engine for this decode engine: local, whatever it costs, and the decision
    says so (10 streams over a 50 ms gap target); the pool's pair choice ranks on it."""
    d = decide(AUTO, RouteInputs(1000, prefill_available=False, costs=costs(), streams=10,
                                 targets=Targets(ttft_s=1.0, itl_s=0.05)))
    assert (d.route, d.reason) == ("local", "prefill_unavailable")
    assert d.gap_local_s > 0.05 and d.over_targets == 10


async def test_the_pool_does_not_pick_an_engine_whose_only_route_stalls_its_streams():
    """e0 serves both roles and has two streams, e1 decodes only and is idle (routing set by
    ``POST /pd/admin/routing``): a long prompt on e0 could only be computed locally, stalling
    both; on e1 it stalls nothing."""
    pool, _, orch = pool_setup()
    orch.targets = Targets(ttft_s=10.0, itl_s=0.05)
    e0, e1 = pool.all()
    claims = [(await planned_on(orch, e0))[1] for _ in range(2)]
    pool.assign(prefill=["e0"], decode=["e0", "e1"])
    try:
        plan = await orch.plan(request(prompt=list(range(100, 500))))
        assert plan.decode is e1, (plan.decode.name, plan.decision)
    finally:
        for c in claims:
            c.release()


def test_a_route_taken_for_least_violation_holds_the_stalls_it_spends():
    """Both routes miss the TTFT target; local's two chunk stalls fit the streams' room: it
    is taken, and the stalls it spends are held (or a second arrival spends them too)."""
    inputs = RouteInputs(1000, costs=costs(prefill_queue_s=2.0), streams=4,
                         targets=Targets(ttft_s=0.1, itl_s=0.05), stall_room=2)
    d = decide(AUTO, inputs)
    assert (d.route, d.reason) == ("local", "slo_least_violation")
    assert d.gap_local_s > 0.05
    assert d.stalls == stalls_needed("local", 1000, 512) == 2


async def test_no_disaggregated_estimate_without_a_prefill_engine():
    """The estimate header prices only routes that exist (a route without a prefill engine
    would be priced from the priors alone)."""
    from proxy.plan import estimate_header

    _, _, orch = setup(prefills=())
    plan = await orch.plan(request())
    assert plan.prefill is None and plan.decision.reason == "prefill_unavailable"
    header = estimate_header(plan) or ""
    assert header.startswith("local=") and "disaggregated=" not in header
