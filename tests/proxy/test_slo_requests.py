"""A request's own latency targets (``slo``): validated at the proxy (400, no engine called),
used for its decision, never forwarded to an engine."""

from __future__ import annotations

import httpx
import pytest

from harness.live_proxy import live_proxy, proxy_config

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4}


async def test_slo_is_taken_out_and_never_reaches_an_engine(prefill, decode):
    async with live_proxy(proxy_config(prefill, decode)) as lp, httpx.AsyncClient() as c:
        r = await c.post(lp.url + "/v1/completions",
                         json=dict(BODY, slo={"ttft_ms": 500, "itl_ms": 40}))
        assert r.status_code == 200, r.text
    sent = [*prefill.prefill_requests, *decode.decode_requests]
    assert sent and all("slo" not in rec.body for rec in sent)


@pytest.mark.parametrize("slo", [
    [], "fast", {"ttft_ms": 0}, {"ttft_ms": -5}, {"itl_ms": "40"}, {"itl_ms": True},
    {"ttft_ms": 1e12}, {"ttft": 500}, {"ttft_ms": 500, "p99": 1}, None,
])
async def test_bad_slo_is_a_400_and_no_engine_is_called(prefill, decode, slo):
    async with live_proxy(proxy_config(prefill, decode)) as lp, httpx.AsyncClient() as c:
        r = await c.post(lp.url + "/v1/completions", json=dict(BODY, slo=slo))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "slo" and err["type"] == "invalid_request_error"
    assert prefill.completion_requests == [] and decode.completion_requests == []


@pytest.mark.parametrize("depth", [1000, 5000])
@pytest.mark.parametrize("shape", ["array", "object"])
async def test_deeply_nested_json_is_a_400_not_a_500(prefill, decode, depth, shape):
    """A small body of deeply nested JSON once made the proxy answer 500 in plain text
    (msgspec's RecursionError escaped): now an OpenAI-style 400, no engine called."""
    inner = (b"[" * depth + b"]" * depth) if shape == "array" else (
        b'{"a":' * depth + b"1" + b"}" * depth)
    raw = b'{"model": "m", "prompt": "hi", "x": ' + inner + b"}"
    async with live_proxy(proxy_config(prefill, decode)) as lp, httpx.AsyncClient() as c:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = await c.post(lp.url + path, content=raw,
                             headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.headers["content-type"].startswith("application/json")
            assert "nested too deeply" in r.json()["error"]["message"]
    assert prefill.completion_requests == [] and decode.completion_requests == []
