"""Load-or-recompute on a real throttled link (prefill in its own network namespace).

The case: a long document the prefill engine already holds in its prefix cache, the decode
engine does not. Moving its KV beats recomputing it when the link is fast and loses when the link
is slow; a queue on the prefill engine flips the answer too. Each case checks the proxy's choice
against both routes measured on the real engines.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from launch.testbed import LinkSpec, ThrottledLink, available
from tests.e2e.prompts import text_of_tokens
from tests.e2e.routes import (
    cache_on_prefill,
    costs,
    measure_disaggregated,
    reset_decode_cache,
    run_case,
    ttft_stream,
    wait_for,
)
from tests.e2e.stack import start_stack, stop_stack

pytestmark = pytest.mark.skipif(not available(), reason="needs root + ip/tc for netns")

DOC_TOKENS = 3000
SLOW_MBIT = 20.0


@pytest.fixture(scope="module")
def link_stack(tmp_path_factory):
    stack = start_stack(
        "tiny", port=19000, engine_base_port=19100, side_channel_base_port=19600,
        log_dir=tmp_path_factory.mktemp("link-stack"), model_name="pdserve-tiny",
        extra=["--policy", "auto", "--link-mbit", "0", "--kv-events-base-port", "19700",
               "--kv-cache-gib", "1",
               "--engine-dev-endpoints", "--reprobe-s", "5", "--probe-tokens", "64,512,1536"],
    )
    stack.prefill_url = stack.run_info()["engines"][0]["url"]
    yield stack
    assert not stop_stack(stack)


def test_fast_link_moves_kv_slow_link_recomputes(link_stack):
    link = ThrottledLink.attach()
    link.set_rate(LinkSpec(None))
    fast = run_case(link_stack, DOC_TOKENS, seed=101)
    print("fast link:", fast)
    assert fast["route"] == "disaggregated", fast
    assert fast["disaggregated"] < fast["local"], fast  # the choice was right: measured

    link.set_rate(LinkSpec(SLOW_MBIT))
    try:
        # The re-probe loop measures the slower link within seconds; wait for the estimate.
        wait_for(lambda: min(v["bytes_per_s"] for v in costs(link_stack)["links"].values())
                 < SLOW_MBIT * 1e6 / 8 * 2, "the link estimate to drop")
        slow = run_case(link_stack, DOC_TOKENS, seed=202)
        print("slow link:", slow)
        assert slow["route"] == "local", slow
        assert slow["local"] < slow["disaggregated"], slow
    finally:
        link.set_rate(LinkSpec(None))


def test_busy_prefill_sends_request_local(link_stack):
    """Idle, this request would be disaggregated (its prefix is cached on prefill); with a
    queue of long prompts on the prefill engine it goes local, and finishes sooner than it
    would have through the queue."""
    doc = text_of_tokens(DOC_TOKENS, seed=303)
    body = {"model": link_stack.model_name, "prompt": doc + " so", "max_tokens": 2,
            "temperature": 0}
    cache_on_prefill(link_stack, doc, DOC_TOKENS)
    reset_decode_cache(link_stack, body)

    def flood(seed: int) -> list[threading.Thread]:
        def one(i: int) -> None:
            httpx.post(link_stack.prefill_url + "/v1/completions", timeout=300, json={
                "model": link_stack.model_name, "prompt": text_of_tokens(3000, seed=seed + i),
                "max_tokens": 1})
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: costs(link_stack)["engines"]["prefill-0"]["engine_requests"] >= 3,
                 "the proxy to see the prefill queue", timeout_s=30)
        return threads

    threads = flood(1000)
    with httpx.Client(timeout=300) as c:
        ttft, headers = ttft_stream(c, link_stack.proxy_url + "/v1/completions", body)
    for t in threads:
        t.join()
    assert headers["x-pd-route"] == "local", dict(headers)
    metrics = httpx.get(link_stack.proxy_url + "/metrics").text
    assert 'pd_decisions_total{reason="prefill_congested",route="local"}' in metrics

    # The same request through the same kind of queue, disaggregated.
    threads = flood(2000)
    through_queue = measure_disaggregated(link_stack, body)
    for t in threads:
        t.join()
    print(f"local under prefill load: {ttft:.3f}s, through the queue: {through_queue:.3f}s")
    assert ttft < through_queue
