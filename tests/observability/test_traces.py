"""One P/D request is one trace across the proxy and both engines (dev mode):
``tests/trace_checks.py`` says what that trace must hold."""

from __future__ import annotations

import httpx

from harness.engine_io import chat_body
from harness.prompts import text_of_tokens
from tests.trace_checks import assert_one_pd_trace


def test_a_pd_request_is_one_trace_across_proxy_and_both_engines(obs_stack, otlp):
    r = httpx.post(obs_stack.proxy_url + "/pd/admin/routing", json={"policy": "disaggregate"},
                   timeout=30)
    assert r.status_code == 200
    try:
        body = dict(chat_body(obs_stack.model_name, text_of_tokens(300, seed=977),
                              stream=True), max_tokens=8)
        with httpx.Client(timeout=120) as c, c.stream(
                "POST", obs_stack.proxy_url + "/v1/chat/completions", json=body,
                headers={"x-request-id": "trace-me"}) as resp:
            assert resp.status_code == 200 and resp.headers["x-pd-route"] == "disaggregated"
            resp.read()
    finally:
        httpx.post(obs_stack.proxy_url + "/pd/admin/routing", json={"policy": "auto"},
                   timeout=30)
    assert_one_pd_trace(otlp.request_trace("trace-me"), "trace-me", "prefill-0", "decode-0")
