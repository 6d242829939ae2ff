"""Per-request KV limits (``kv_limits``): validated at the proxy, translated into the engines'
``kv_transfer_params`` on both legs, never passed through raw."""

from __future__ import annotations

import httpx
import pytest

from harness.live_proxy import live_proxy, proxy_config
from transport import kv_params

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4}
LIMITS = {"max_load_tokens": 256, "max_offload_tokens": 0, "load_tiers": ["cpu"]}
WANT = {"max_load_tokens": 256, "max_offload_tokens": 0, "kv_load_tiers": [{"medium": "CPU"}]}


@pytest.mark.parametrize("policy", ["disaggregate", "local"])
async def test_limits_reach_both_engines_translated(prefill, decode, policy):
    async with live_proxy(proxy_config(prefill, decode, policy=policy)) as lp, \
            httpx.AsyncClient() as c:
        r = await c.post(lp.url + "/v1/completions", json=dict(BODY, kv_limits=LIMITS))
        assert r.status_code == 200, r.text
    sent = [*prefill.prefill_requests, *decode.decode_requests]
    assert len(sent) == (2 if policy == "disaggregate" else 1)
    for rec in sent:
        assert "kv_limits" not in rec.body
        params = rec.body["kv_transfer_params"]
        assert {k: params[k] for k in WANT} == WANT
    if policy == "disaggregate":  # the hand-off itself still reaches decode intact
        assert decode.decode_requests[0].body["kv_transfer_params"]["remote_block_ids"] == \
            prefill.handoffs[0]["remote_block_ids"]
    else:  # local: only the limits, nothing that would make decode pull from anywhere
        assert set(decode.decode_requests[0].body["kv_transfer_params"]) == set(WANT)


@pytest.mark.parametrize("limits", [
    [], {"max_load_tokens": -1}, {"max_load_tokens": "5"}, {"max_load_tokens": True},
    {"load_tiers": ["gpu"]}, {"load_tiers": "cpu"}, {"remote_host": "10.0.0.1"},
])
async def test_bad_limits_are_a_400_and_no_engine_is_called(prefill, decode, limits):
    async with live_proxy(proxy_config(prefill, decode)) as lp, httpx.AsyncClient() as c:
        r = await c.post(lp.url + "/v1/completions", json=dict(BODY, kv_limits=limits))
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_limits", r.text
    assert not prefill.completion_requests and not decode.completion_requests


def test_limits_translation_is_pure():
    lim = kv_params.parse_limits({"load_tiers": ["cpu", "cpu", "storage"]})
    assert lim.params() == {"kv_load_tiers": [{"medium": "CPU"}, {"medium": "STORAGE"}]}
    assert kv_params.parse_limits({"load_tiers": []}).params() == {"kv_load_tiers": []}
    assert kv_params.with_limits(None, None) is None
    assert kv_params.with_limits(None, kv_params.KVLimits()) is None
    assert kv_params.with_limits({"a": 1}, None) == {"a": 1}
