"""One P/D request is one trace: the proxy's spans and both engines' own (vLLM's
``llm_request``, exported by the engines themselves) share its trace id, the engines' spans are
children of the proxy's ``prefill`` and ``decode`` spans, and the stages are in causal order."""

from __future__ import annotations

import time

import httpx

from harness.engine_io import chat_body
from harness.prompts import text_of_tokens


def wait_trace(otlp, request_id: str, timeout_s: float = 60.0) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        roots = [s for s in otlp.spans if s.name == "pdserve.request"
                 and s.attributes.get("pd.request_id") == request_id]
        if roots:
            spans = otlp.trace(roots[0].trace_id)
            if sum(s.name == "llm_request" for s in spans) >= 2:
                return spans
        assert time.monotonic() < deadline, [s.name for s in otlp.spans][-40:]
        time.sleep(0.2)


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
    spans = wait_trace(otlp, "trace-me")
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (root,) = by_name["pdserve.request"]
    assert root.parent_id == "" and root.attributes["pd.route"] == "disaggregated"
    for stage in ("admission", "tokenize", "decision", "prefill", "handover", "decode", "relay"):
        (span,) = by_name[stage]
        assert span.parent_id == root.span_id, stage
        assert span.attributes["pd.request_id"] == "trace-me", stage
        assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns, stage
        if stage not in ("admission", "tokenize"):  # known from the decision on
            assert span.attributes["pd.route"] == "disaggregated", stage
    (prefill,), (decode,) = by_name["prefill"], by_name["decode"]
    assert prefill.attributes["pd.engine"] == "prefill-0"
    assert decode.attributes["pd.engine"] == "decode-0"
    # Each engine's own span is a child of the proxy span that called it.
    engine_spans = {s.parent_id: s for s in by_name["llm_request"]}
    assert set(engine_spans) == {prefill.span_id, decode.span_id}, by_name["llm_request"]
    on_prefill, on_decode = engine_spans[prefill.span_id], engine_spans[decode.span_id]
    # Causal order: prefill on its engine, then the decode request, its first byte, the relay.
    order = [by_name["admission"][0], by_name["decision"][0], prefill, decode,
             by_name["relay"][0]]
    assert [s.start_ns for s in order] == sorted(s.start_ns for s in order)
    assert prefill.start_ns <= on_prefill.start_ns <= prefill.end_ns + 5_000_000
    assert by_name["handover"][0].start_ns <= decode.start_ns + 5_000_000
    assert on_decode.start_ns >= prefill.start_ns
