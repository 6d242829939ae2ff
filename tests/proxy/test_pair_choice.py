"""Where engines serve both roles (``--layout pool``) and a request has targets, the pair of
engines is picked by the targets rule: the fewest requests over a target, then the least
violation, then a decode engine that already has streams (keeping another free of them for the
next prefill), then the faster first token, then least work."""

from __future__ import annotations

import pytest

from proxy.pair_choice import PairOption, best_pair
from proxy.policy import Decision, Targets
from tests.proxy.test_pool_stall import planned_on, pool_setup
from tests.proxy.test_routing import request


def option(name, over=0, violation=0.0, streams=0, ttft=0.1, work=0.0):
    return PairOption(name, None, Decision("local", "test", ttft, ttft, over_targets=over,
                                           violation=violation), streams, work)


# (name, options, the decode engine picked)
CASES = [
    ("fewer requests over a target wins over everything after",
     [option("a", over=1, streams=3, ttft=0.01), option("b", over=0, ttft=0.5)], "b"),
    ("then the least violation",
     [option("a", over=1, violation=0.5, streams=3), option("b", over=1, violation=0.2)], "b"),
    ("then a decode engine with streams already: another stays free for prefills",
     [option("idle", ttft=0.05), option("busy", streams=2, ttft=0.2)], "busy"),
    ("all idle: the faster first token",
     [option("a", ttft=0.2), option("b", ttft=0.1)], "b"),
    ("all alike: the least work",
     [option("a", work=500.0), option("b", work=100.0)], "b"),
]


@pytest.mark.parametrize("name,options,picked", CASES, ids=[c[0][:50] for c in CASES])
def test_best_pair(name, options, picked):
    assert best_pair(options).decode == picked, name


async def test_a_pool_keeps_an_engine_free_of_streams_for_long_prompts():
    """e0 has streams, e1 none. Least work alone would put a long prompt on e1 (local): then
    both engines decode, and the next long prompt stalls somebody wherever it is computed. The
    pair picked is e0 to decode and e1 to prefill: nothing is stalled, e1 stays free."""
    pool, costs_, orch = pool_setup()
    orch.targets = Targets(ttft_s=10.0, itl_s=0.05)
    e0, e1 = pool.all()
    long = request(prompt=list(range(100, 500)))  # 400 tokens: one ~0.2 s step at the prior
    idle = await orch.plan(long)
    assert idle.decision.route == "local" and idle.decision.reason == "slo_local_fits"
    claims = [(await planned_on(orch, e0))[1] for _ in range(2)]
    plan = await orch.plan(long)
    assert (plan.decode.name, plan.prefill.name) == ("e0", "e1")
    assert (plan.decision.route, plan.decision.reason) == ("disaggregated",
                                                           "slo_protects_streams")
    assert plan.decision.over_targets == 0
    orch.targets = Targets()  # without targets: least work, as before (e1, computed there)
    plain = await orch.plan(long)
    assert (plain.decode.name, plain.decision.route) == ("e1", "local")
    for claim in claims:
        claim.release()


async def test_with_streams_on_every_engine_the_prompt_is_computed_where_it_stalls_fewest():
    """e0 has two streams, e1 one: a long prompt stalls somebody wherever it is computed. It is
    computed on e1, one request over the gap target instead of two."""
    pool, costs_, orch = pool_setup()
    orch.targets = Targets(ttft_s=10.0, itl_s=0.05)
    e0, e1 = pool.all()
    claims = [(await planned_on(orch, e))[1] for e in (e0, e0, e1)]
    plan = await orch.plan(request(prompt=list(range(100, 500))))
    assert plan.decision.over_targets == 1
    computed_on = plan.decode if plan.decision.route == "local" else plan.prefill
    assert computed_on.name == "e1"
    for claim in claims:
        claim.release()


async def test_a_suspect_engine_is_neither_pair_s_decode_engine_while_another_can_be():
    """e0's requests stalled (suspect, its token probe not answered yet: ``proxy/stalls.py``).
    Where the pair would have been e0 to decode (it has the streams), e1 decodes instead; with
    e1 gone, e0 still serves (a suspect engine is the last choice, not none)."""
    pool, costs_, orch = pool_setup()
    orch.targets = Targets(ttft_s=10.0, itl_s=0.05)
    e0, e1 = pool.all()
    claims = [(await planned_on(orch, e0))[1] for _ in range(2)]
    long = request(prompt=list(range(100, 500)))
    assert (await orch.plan(long)).decode.name == "e0"  # (as above)
    e0.silent = True
    assert (await orch.plan(long)).decode.name == "e1"
    e1.healthy = False
    assert (await orch.plan(long)).decode.name == "e0"
    for claim in claims:
        claim.release()
