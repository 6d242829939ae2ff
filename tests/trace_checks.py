"""What one P/D request's trace must look like, wherever it ran (dev mode, Ray mode): the
proxy's root and stage spans and both engines' own ``llm_request`` spans (vLLM's, exported by
the engines) share one trace id; every stage carries the request id, the route and its
engines; each engine span is the child of the proxy span that called it; the stages are in
causal order."""

from __future__ import annotations

from typing import Any

STAGES = ("admission", "tokenize", "decision", "prefill", "handover", "decode", "relay")
#: Slack for clocks: the engines stamp their spans with their own reading of the wall clock.
SKEW_NS = 5_000_000


def assert_one_pd_trace(spans: list[Any], request_id: str, prefill: str, decode: str) -> None:
    by_name: dict[str, list[Any]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (root,) = by_name["pdserve.request"]
    assert root.parent_id == "" and root.attributes["pd.route"] == "disaggregated"
    for stage in STAGES:
        (span,) = by_name[stage]
        assert span.parent_id == root.span_id, stage
        assert span.attributes["pd.request_id"] == request_id, stage
        assert span.attributes["pd.route"] == "disaggregated", stage
        named = {span.attributes.get(k) for k in ("pd.engine", "pd.prefill", "pd.decode")}
        assert named & {prefill, decode}, (stage, span.attributes)
        assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns, stage
    (on_prefill,), (on_decode,) = by_name["prefill"], by_name["decode"]
    assert on_prefill.attributes["pd.engine"] == prefill
    assert on_decode.attributes["pd.engine"] == decode
    # Each engine's own span is a child of the proxy span that called it.
    engine_spans = {s.parent_id: s for s in by_name["llm_request"]}
    assert set(engine_spans) == {on_prefill.span_id, on_decode.span_id}, by_name["llm_request"]
    in_prefill, in_decode = engine_spans[on_prefill.span_id], engine_spans[on_decode.span_id]
    # Causal order: prefill on its engine, then the decode request, its first byte, the relay.
    order = [by_name["admission"][0], by_name["decision"][0], on_prefill, on_decode,
             by_name["relay"][0]]
    assert [s.start_ns for s in order] == sorted(s.start_ns for s in order)
    assert on_prefill.start_ns <= in_prefill.start_ns <= on_prefill.end_ns + SKEW_NS
    assert by_name["handover"][0].start_ns <= on_decode.start_ns + SKEW_NS
    assert in_decode.start_ns >= on_prefill.start_ns
