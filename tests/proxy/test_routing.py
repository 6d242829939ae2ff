"""Which engines a request is given: least outstanding work in tokens, counting what the
request itself would add there (prompt tokens the engine has not cached, its output budget)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.costs import RouteCosts
from proxy.deadlines import Deadlines
from proxy.engine_bodies import DEFAULT_OUTPUT_BUDGET, output_budget
from proxy.metrics import ProxyMetrics
from proxy.orchestrator import Orchestrator
from proxy.policy import Targets, parse_policy
from proxy.pool import EnginePool
from proxy.prefix_index import block_keys
from proxy.requests import ApiRequest
from proxy.tokens import PromptTokens
from transport.kv_events import BlocksStored

BS = 16
PROMPT = list(range(100, 164))  # 64 tokens: four blocks


@dataclass
class Named:
    name: str


class Ids:
    """Prompts that are token ids already, measured the way the tokenizer pool measures."""

    async def measure(self, body, block_sizes):
        ids = list(body["prompt"])
        return PromptTokens(len(ids), {bs: block_keys(ids, bs) for bs in block_sizes})


def setup(prefills=("p0", "p1"), decodes=("d0", "d1")):
    pool = EnginePool([Named(n) for n in prefills], [Named(n) for n in decodes], ProxyMetrics())
    for e in pool.all():
        e.healthy = True
    costs = RouteCosts(kv_bytes_per_token=1000)
    orch = Orchestrator(pool, parse_policy("disaggregate"), Deadlines(), ProxyMetrics(), costs,
                        prompts=Ids())
    return pool, costs, orch


async def planned(orch, req):
    """Plan ``req`` and claim its output budget on its decode engine, as ``serve`` does."""
    plan = await orch.plan(req)
    return plan, orch.ledger.claim(plan.decode, output_tokens=plan.output_budget)


def cache(engine, tokens):
    engine.index.apply([BlocksStored(tuple(range(len(tokens) // BS)), None, tuple(tokens),
                                     BS, "GPU")])


def request(max_tokens=16, prompt=PROMPT):
    return ApiRequest("completions", {"model": "m", "prompt": prompt, "max_tokens": max_tokens},
                      False, "r")


async def test_prefill_with_the_prefix_cached_is_chosen_over_rotation():
    pool, _, orch = setup()
    cache(pool.get("p1"), PROMPT[:48])
    for _ in range(3):  # p1 has 48 of 64 tokens: 16 new ones there, 64 on p0
        assert (await orch.plan(request())).prefill.name == "p1"


async def test_a_whole_prompt_cached_still_has_its_last_block_computed():
    """vLLM computes a prompt's last token whatever it holds: a prompt cached whole, in whole
    blocks, is a hit of all but its last block."""
    pool, _, orch = setup()
    cache(pool.get("d0"), PROMPT)
    cache(pool.get("d1"), PROMPT)
    plan = await orch.plan(request())
    assert len(PROMPT) % BS == 0 and plan.decode_cached_tokens == len(PROMPT) - BS


async def test_cached_prefix_loses_once_its_engine_is_loaded_more_than_it_saves():
    pool, costs, orch = setup()
    cache(pool.get("p1"), PROMPT[:48])
    orch.ledger.claim(pool.get("p1"), prompt_tokens=40)  # 40 + 16 new < 0 + 64 new on p0
    assert (await orch.plan(request())).prefill.name == "p1"
    orch.ledger.claim(pool.get("p1"), prompt_tokens=20)  # 60 + 16 > 64: p0
    assert (await orch.plan(request())).prefill.name == "p0"


async def test_decode_load_counts_output_budgets_and_releases_them():
    _, costs, orch = setup()
    long, long_claim = await planned(orch, request(max_tokens=1000))
    assert long.decode.name == "d0" and costs.load_tokens("d0") == 1000
    # By request count they would alternate; by tokens the short ones go to d1 until d1
    # holds as much as the long answer's budget.
    shorts = [await planned(orch, request(max_tokens=100)) for _ in range(11)]
    assert [t.decode.name for t, _ in shorts] == ["d1"] * 10 + ["d0"]
    assert costs.load_tokens("d1") == 1000 and costs.load_tokens("d0") == 1100
    for claim in [long_claim, *(c for _, c in shorts)]:
        claim.output_done()
    assert costs.load_tokens("d0") == costs.load_tokens("d1") == 0


async def test_streamed_tokens_come_off_the_budget():
    _, costs, orch = setup()
    t, claim = await planned(orch, request(max_tokens=10))
    claim.output_done(3)
    assert costs.load_tokens(t.decode.name) == 7
    claim.output_done(30)  # more frames than budget (role frame, usage frame)
    assert costs.load_tokens(t.decode.name) == 0 and claim.output_tokens == 0


async def test_other_clients_requests_count_at_the_engines_mean_prompt_size():
    pool, costs, orch = setup()
    d0 = pool.get("d0")
    d0._foreign, d0.mean_prompt_tokens = 2, 300.0
    assert costs.load_tokens("d0", d0.foreign_requests, d0.mean_prompt_tokens) == 600
    assert (await planned(orch, request(max_tokens=100)))[0].decode.name == "d1"
    # d1 has seen no mean yet: the typical prompt size this proxy has seen stands in.
    assert costs.load_tokens("d1", 1, None) == 100 + costs.typical_prompt_tokens


async def test_output_budget_is_the_requests_max_tokens():
    assert output_budget({"max_tokens": 7}) == 7
    assert output_budget({"messages": [], "max_completion_tokens": 9, "max_tokens": 7}) == 9
    assert output_budget({"messages": [], "max_completion_tokens": None, "max_tokens": 7}) == 7
    # A completion's is max_tokens alone: vLLM reads no max_completion_tokens there.
    assert output_budget({"prompt": "x", "max_completion_tokens": 9, "max_tokens": 7}) == 7
    assert output_budget({}) == DEFAULT_OUTPUT_BUDGET


async def test_a_request_still_prefilling_counts_as_a_stream_a_local_prefill_would_stall():
    """With targets, a long local prefill must not start on a decode engine whose next stream
    is a moment away: a request bound there, still prefilling, starts decoding during it."""
    pool, costs, orch = setup(prefills=("p0",), decodes=("d0",))
    orch.policy = parse_policy("auto")
    orch.targets = Targets(ttft_s=10.0, itl_s=0.05)
    long = request(prompt=list(range(100, 500)))  # 400 tokens: one ~0.2 s step at the prior
    alone = (await orch.plan(long)).decision
    assert (alone.route, alone.reason) == ("local", "slo_local_fits")
    bound, claim = await planned(orch, request())  # bound for d0, not streaming yet
    assert bound.decode.name == "d0" and costs.tracker("d0").streams == 0
    exposed = (await orch.plan(long)).decision
    assert (exposed.route, exposed.reason) == ("disaggregated", "slo_protects_streams")
    assert exposed.gap_local_s > 0.05
    claim.release()
    assert (await orch.plan(long)).decision.route == "local"
