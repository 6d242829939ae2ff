"""The auto policy and the estimators that feed it, on recorded samples."""

from __future__ import annotations

import random

import pytest

from proxy.costs import RouteCosts
from proxy.estimators import LinkFit, PrefillFit, TokenRatio
from proxy.policy import CostInputs, RouteInputs, decide, parse_policy, predict
from transport.cost import LinkModel, PrefillModel

AUTO = parse_policy("auto")
FAST = PrefillModel(fixed_s=0.01, tokens_per_s=4000.0)
SLOW = PrefillModel(fixed_s=0.01, tokens_per_s=500.0)
KVB = 4096


def costs(link_mb_s: float, remote=FAST, local=FAST, pq=0.0, dq=0.0) -> CostInputs:
    return CostInputs(KVB, remote, local, LinkModel(0.02, link_mb_s * 1e6), pq, dq)


@pytest.mark.parametrize(
    "n,c,want_route,want_reason",
    [
        # Same engines, idle: moving KV only adds cost.
        (1000, costs(1000), "local", "recompute_cheaper"),
        # Decode is slow at prompts (busy), link fast: transfer wins.
        (2000, costs(1000, local=SLOW), "disaggregated", "transfer_cheaper"),
        # ... unless the link is slow (1 MB/s: 8 s for 2000 tokens of 4 KiB).
        (2000, costs(1, local=SLOW), "local", "recompute_cheaper"),
        # Prefill side congested by a queue of long prompts.
        (200, costs(1000, local=SLOW, pq=5.0), "local", "prefill_congested"),
    ],
)
def test_auto_decisions(n, c, want_route, want_reason):
    d = decide(AUTO, RouteInputs(prompt_tokens=n, costs=c))
    assert (d.route, d.reason) == (want_route, want_reason)
    assert d.predicted_disaggregated_s is not None and d.predicted_local_s is not None


def test_auto_prefers_local_when_decode_has_the_prefix():
    d = decide(AUTO, RouteInputs(prompt_tokens=500, decode_cached_tokens=500,
                                 costs=costs(1000, local=SLOW)))
    assert (d.route, d.reason) == ("local", "cached_on_decode")


def test_auto_counts_prefix_cached_on_prefill():
    # Prefill has 1900 of 2000 tokens cached: remote side almost free, transfer of 2000 at
    # 100 MB/s = 82 ms vs 2000/500 = 4 s local.
    inp = RouteInputs(prompt_tokens=2000, prefill_cached_tokens=1900,
                      costs=costs(100, remote=SLOW, local=SLOW))
    disagg, local = predict(inp, inp.costs)
    assert disagg < 0.5 < local
    assert decide(AUTO, inp).route == "disaggregated"


def test_a_disaggregated_first_token_waits_for_the_prompts_queued_on_the_decode_engine():
    """The KV goes in, and the first token comes out, in the decode engine's own steps: after
    the prompt work queued there, however idle the prefill engine is."""
    inp = RouteInputs(prompt_tokens=64, costs=costs(1000, pq=0.0, dq=4.0))
    disagg, local = predict(inp, inp.costs)
    assert 4.0 < disagg < local
    busy_prefill = RouteInputs(prompt_tokens=64, costs=costs(1000, pq=6.0, dq=4.0))
    assert predict(busy_prefill, busy_prefill.costs)[0] > 6.0


def test_auto_without_prefill_is_local_and_without_model_disaggregates():
    assert decide(AUTO, RouteInputs(100, prefill_available=False, costs=costs(1))).route == "local"
    assert decide(AUTO, RouteInputs(100)).reason == "no_cost_model"


def test_prefill_fit_recovers_model_from_noisy_samples():
    truth = PrefillModel(fixed_s=0.03, tokens_per_s=2500.0, quad_s=2e-8)
    fit = PrefillFit(PrefillModel(1.0, 10.0))
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(50, 3000)
        fit.observe(n, truth.seconds(n) * rng.uniform(0.95, 1.05))
    m = fit.model()
    for n in (100, 1000, 3000):
        assert m.seconds(n) == pytest.approx(truth.seconds(n), rel=0.1)


def test_prefill_fit_keeps_prior_until_enough_distinct_samples():
    prior = PrefillModel(0.5, 100.0)
    fit = PrefillFit(prior)
    fit.observe(100, 0.1)
    fit.observe(100, 0.1)
    fit.observe(100, 0.1)
    assert fit.model() == prior


def test_link_fit_recovers_bandwidth_and_fixed_cost():
    fit = LinkFit(LinkModel(1.0, 1.0), kv_bytes_per_token=KVB)
    for n in (100, 500, 1000, 2000, 3000):
        fit.observe(n, 0.04 + n * KVB / 12e6)
    m = fit.model()
    assert m.fixed_s == pytest.approx(0.04, abs=1e-3)
    assert m.bytes_per_s == pytest.approx(12e6, rel=0.01)


def test_token_ratio_converges():
    r = TokenRatio(prior=0.25)
    for _ in range(100):
        r.observe(1000, 180)
    assert r.tokens(1000) == pytest.approx(180, abs=2)


def test_route_costs_queue_accounting():
    from proxy.pool import Engine

    rc = RouteCosts(KVB)
    p = Engine("prefill", _Named("p"))
    first = rc.ledger.claim(p, prompt_tokens=1000)
    second = rc.ledger.claim(p, prompt_tokens=500)
    assert first.was_idle is True and second.was_idle is False
    assert rc.inputs("p", "d").prefill_queue_s > 0 and p.inflight == 2
    first.release()
    second.prompt_done()
    second.release()
    second.release()  # idempotent
    assert rc.queued_tokens("p") == 0 and p.inflight == 0
    assert rc.inputs("p", "d").prefill_queue_s == 0


class _Named:
    def __init__(self, name: str):
        self.name = name


def test_engine_load_reads_running_and_waiting_only():
    from transport.engine_metrics import engine_load

    text = (
        '# HELP vllm:num_requests_running x\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 3.0\n'
        'vllm:num_requests_running_total 99\n'
    )
    assert engine_load(text).requests == 5


def test_foreign_load_adds_queue_time():
    rc = RouteCosts(KVB)
    idle = rc.inputs("p", "d")
    busy = rc.inputs("p", "d", prefill_foreign_requests=4)
    assert busy.prefill_queue_s > idle.prefill_queue_s + 0.1
    assert busy.decode_queue_s == idle.decode_queue_s


def test_link_fit_follows_a_link_that_slows_down():
    fit = LinkFit(LinkModel(0.01, 1e9), kv_bytes_per_token=KVB)
    for n in (256, 1024, 256, 1024, 256, 1024, 256, 1024):
        fit.observe(n, 0.02 + n * KVB / 1e9)  # fast link
    for n in (1024, 256, 1024, 1024):
        fit.observe(n, 0.02 + n * KVB / 2.5e6)  # throttled to 20 Mbit/s
    assert fit.model().bytes_per_s < 10e6


def test_link_fit_follows_a_link_that_recovers_within_two_hand_overs():
    """Slow for a long time, then fast: two surprising hand-overs reset the fit, so the
    prediction for a long prompt is right again at once (not dragged by the slow past)."""
    fit = LinkFit(LinkModel(0.01, 1e9), kv_bytes_per_token=KVB)
    slow, fast = 2.5e6, 1.2e9
    for n in (64, 256) * 8:
        fit.observe(n, 0.03 + n * KVB / slow)
    assert fit.model().bytes_per_s == pytest.approx(slow, rel=0.05)
    fit.observe(64, 0.03 + 64 * KVB / fast)
    fit.observe(256, 0.03 + 256 * KVB / fast)
    want = 0.03 + 1500 * KVB / fast
    assert fit.model().seconds(1500, KVB) == pytest.approx(want, rel=0.5)
    fit.observe(64, 0.03 + 64 * KVB / fast)  # three new samples, two sizes: a real fit again
    assert fit.model().bytes_per_s == pytest.approx(fast, rel=0.05)
    assert fit.model().fixed_s == pytest.approx(0.03, rel=0.05)


def test_link_fit_ignores_one_outlier():
    fit = LinkFit(LinkModel(0.01, 1e9), kv_bytes_per_token=KVB)
    for n in (64, 256) * 4:
        fit.observe(n, 0.03 + n * KVB / 1e9)
    fit.observe(256, 5.0)  # one stalled hand-over
    fit.observe(64, 0.03 + 64 * KVB / 1e9)
    assert fit.n_samples == 10  # nothing dropped


def test_engine_reads_nixl_pull_rate_from_its_metrics():
    """The decode engine's own NIXL histograms give the wire rate of its recent pulls."""
    from proxy.pool import Engine

    def text(nbytes: float, secs: float, count: int) -> str:
        return (f'vllm:nixl_bytes_transferred_sum{{engine="0"}} {nbytes}\n'
                f'vllm:nixl_xfer_time_seconds_sum{{engine="0"}} {secs}\n'
                f'vllm:nixl_xfer_time_seconds_count{{engine="0"}} {count}\n'
                'vllm:num_requests_running{engine="0"} 0.0\n')

    e = Engine("decode", client=None)  # type: ignore[arg-type]
    e.update_load(text(0, 0, 0))
    assert e.nixl_bytes_per_s is None
    e.update_load(text(0, 0, 0))  # no transfer since: still unknown
    assert e.nixl_bytes_per_s is None
    e.update_load(text(1e9, 0.5, 4))  # 1 GB in 0.5 s of transfer time
    assert e.nixl_bytes_per_s == pytest.approx(2e9) and e.nixl_transfers == 4
    e.update_load(text(1e9 + 1e8, 0.5 + 0.1, 5))  # the next pull at 1 GB/s
    assert e.nixl_bytes_per_s == pytest.approx(1.5e9)


def test_foreign_load_is_counted_when_the_engine_is_read():
    """A reading taken while this proxy had 2 requests on the engine, which then finished:
    they must not turn into 'foreign' queue for the next decisions."""
    from proxy.pool import Engine

    e = Engine("prefill", client=None)  # type: ignore[arg-type]
    e.inflight = 2
    e.update_load('vllm:num_requests_running{engine="0"} 2.0\n'
                  'vllm:num_requests_waiting{engine="0"} 1.0\n')
    assert e.foreign_requests == 1  # one request of another client
    e.inflight = 0  # ours finished; the reading is still the old one
    assert e.foreign_requests == 1


def test_link_fit_learns_nothing_from_hand_overs_of_a_few_tokens():
    """A 3-token hand-over is all fixed cost: rescaling the bandwidth from it once priced a
    1,300-token hand-over at 16 s."""
    fit = LinkFit(LinkModel(0.01, 1e9), kv_bytes_per_token=KVB)
    for n, s in ((1024, 0.014), (256, 0.011), (1024, 0.014), (512, 0.012)):
        fit.observe(n, s)
    before = fit.model()
    for _ in range(4):
        fit.observe(3, 0.05)  # slow, but says nothing about bandwidth
    assert fit.model() == before
