"""64 streaming clients through the proxy (under uvicorn) for a few seconds: nothing lost.

Fast fakes: prefill answers at once, decode streams nine events with a token's pause between
frames. The assertions are about correctness under concurrency: zero errors, every stream whole
and ending with ``data: [DONE]``, every request seen exactly once by each engine, the in-flight
gauge back at 0. Speed is only printed (proxied minus direct TTFT, both against the same fake
in this run); benchmarks measure it (``python -m benchmarks.soak``).

``PDSERVE_LOAD_SECONDS`` sets the proxied run's length (default 5; the direct run takes half).
"""

from __future__ import annotations

import collections
import os

import pytest

from harness.fake_engine import FakeEngine
from harness.live_proxy import live_proxy, proxy_config
from harness.load_driver import (
    CHAT_PATH,
    StreamOutcome,
    make_fast,
    proxy_added_ms,
    run_load,
    ttft_summary_ms,
)

pytestmark = pytest.mark.slow

LOAD_SECONDS = float(os.environ.get("PDSERVE_LOAD_SECONDS", "5"))
CONCURRENCY = 64


def assert_all_whole(outcomes: list[StreamOutcome]) -> None:
    errors = collections.Counter(o.error for o in outcomes if not o.ok)
    assert not errors, f"{sum(errors.values())} of {len(outcomes)} failed: {errors.most_common(3)}"
    assert all(o.done for o in outcomes)


def request_ids(records: list) -> list[str]:
    return [r.request_id for r in records]


async def test_64_streaming_clients_get_every_request_served_exactly_once(
    prefill: FakeEngine, decode: FakeEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    make_fast(decode)
    async with live_proxy(proxy_config(prefill, decode)) as lp:
        direct = await run_load(decode.url + CHAT_PATH, CONCURRENCY, LOAD_SECONDS / 2, "direct")
        assert_all_whole(direct)
        direct_ids = sorted(o.request_id for o in direct)
        assert sorted(request_ids(decode.decode_requests)) == direct_ids
        decode.decode_requests.clear()

        proxied = await run_load(lp.url + CHAT_PATH, CONCURRENCY, LOAD_SECONDS, "proxy")
        assert_all_whole(proxied)
        client_ids = sorted(o.request_id for o in proxied)
        assert len(set(client_ids)) == len(client_ids) > CONCURRENCY
        # Every request reached each engine exactly once, in its role.
        assert sorted(request_ids(prefill.prefill_requests)) == client_ids
        assert sorted(request_ids(decode.decode_requests)) == client_ids
        assert not prefill.decode_requests and not decode.prefill_requests
        assert all("kv_transfer_params" in r.body for r in decode.decode_requests)
        assert prefill.prefill_aborts == decode.decode_aborts == 0

        assert lp.metric("pd_inflight_requests") == 0
        assert lp.state.admission.inflight == 0 and lp.state.admission.queued == 0
        assert not any(lp.outstanding_tokens().values()), lp.outstanding_tokens()
        assert lp.metric("pd_requests_total", endpoint="chat", route="disaggregated",
                         status="200") == len(proxied)
        for stage in ("before_response", "after_prefill", "streaming"):
            assert lp.metric("pd_client_disconnects_total", stage=stage) == 0

    d, p, added = ttft_summary_ms(direct), ttft_summary_ms(proxied), proxy_added_ms(direct, proxied)
    with capsys.disabled():
        print(
            f"\nload c={CONCURRENCY}: {len(proxied)} proxied requests in {LOAD_SECONDS:g}s "
            f"({len(proxied) / LOAD_SECONDS:.0f}/s), {len(direct)} direct, 0 errors; TTFT ms "
            f"direct p50 {d['p50']:.1f} p99 {d['p99']:.1f}, proxied p50 {p['p50']:.1f} "
            f"p99 {p['p99']:.1f}; proxy-added p50 {added['p50']:.1f} p99 {added['p99']:.1f}"
        )
