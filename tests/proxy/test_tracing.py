"""What a request's trace says, on fake engines and the SDK's in-memory exporter: every span
carries the request id, the route and the engines (the stages before the decision too, and the
route the request really took when it fell back); a refused request is a trace of its own; a
failed one says so on its root. The real engines' side (their spans in the same trace) is
``tests/observability/test_traces.py`` and the Ray test."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from harness.fake_engine import FakeEngine
from harness.live_proxy import proxy_config
from proxy.app import create_app
from proxy.tracing import Tracing

CHAT_PATH = "/v1/chat/completions"
STAGES = ("admission", "tokenize", "decision", "prefill", "handover", "decode", "relay")


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Say hello, please."}],
            "max_tokens": 8, "temperature": 0.0, "stream": True} | extra


@contextlib.asynccontextmanager
async def traced(prefill: FakeEngine, decode: FakeEngine, exported: InMemorySpanExporter,
                 **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(proxy_config(prefill, decode, **overrides))
    async with app.router.lifespan_context(app):
        tracing = app.state.pd.tracing = Tracing("unused", exporter=exported)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client
        tracing.shutdown()  # exports what is queued


def of_request(exported: InMemorySpanExporter, request_id: str) -> dict[str, list[Any]]:
    spans: dict[str, list[Any]] = {}
    for s in exported.get_finished_spans():
        if s.attributes.get("pd.request_id") == request_id:
            spans.setdefault(s.name, []).append(s)
    return spans


async def test_every_stage_carries_request_id_route_and_engines(prefill: FakeEngine,
                                                               decode: FakeEngine) -> None:
    exported = InMemorySpanExporter()
    async with traced(prefill, decode, exported, policy="disaggregate") as client:
        resp = await client.post(CHAT_PATH, json=chat(), headers={"x-request-id": "r1"})
        assert resp.status_code == 200 and resp.headers["x-pd-route"] == "disaggregated"
    spans = of_request(exported, "r1")
    (root,) = spans["pdserve.request"]
    assert root.attributes["pd.route"] == "disaggregated"
    assert root.status.status_code == StatusCode.UNSET
    for stage in STAGES:
        (span,) = spans[stage]
        assert span.parent.span_id == root.context.span_id, stage
        assert span.attributes["pd.route"] == "disaggregated", stage
        engines = {span.attributes.get(k) for k in ("pd.engine", "pd.prefill", "pd.decode")}
        assert engines & {"prefill-0", "decode-0"}, (stage, dict(span.attributes))
    for stage in ("admission", "tokenize"):  # before the decision, yet both engines named
        attrs = spans[stage][0].attributes
        assert (attrs["pd.prefill"], attrs["pd.decode"]) == ("prefill-0", "decode-0"), stage


async def test_a_fallback_is_traced_as_the_route_it_took(prefill: FakeEngine,
                                                         decode: FakeEngine) -> None:
    prefill.prefill_status = 500  # the decision says disaggregated; the request goes local
    exported = InMemorySpanExporter()
    async with traced(prefill, decode, exported, policy="disaggregate") as client:
        resp = await client.post(CHAT_PATH, json=chat(), headers={"x-request-id": "r2"})
        assert resp.status_code == 200 and resp.headers["x-pd-route"] == "local"
    spans = of_request(exported, "r2")
    assert spans["pdserve.request"][0].attributes["pd.route"] == "local"
    assert spans["decision"][0].attributes["pd.route"] == "disaggregated"  # what was decided
    for stage in ("admission", "tokenize", "relay"):
        attrs = spans[stage][0].attributes
        assert attrs["pd.route"] == "local", stage
        assert "pd.prefill" not in attrs, stage  # no prefill served it
    assert "handover" not in spans


async def test_a_refused_request_is_a_trace_of_its_own(prefill: FakeEngine,
                                                       decode: FakeEngine) -> None:
    exported = InMemorySpanExporter()
    async with traced(prefill, decode, exported) as client:
        resp = await client.post(CHAT_PATH, json=chat(temperature=-1),
                                 headers={"x-request-id": "bad"})
        assert resp.status_code == 400
    spans = of_request(exported, "bad")
    assert list(spans) == ["pdserve.request"]
    (root,) = spans["pdserve.request"]
    assert root.attributes["pd.status"] == 400
    assert root.attributes["pd.error_type"] == "invalid_request_error"
    assert root.status.status_code == StatusCode.ERROR
    assert not prefill.completion_requests and not decode.completion_requests


@pytest.mark.parametrize("stream", [True, False])
async def test_a_failed_request_says_so_on_its_root(prefill: FakeEngine, decode: FakeEngine,
                                                   stream: bool) -> None:
    exported = InMemorySpanExporter()
    decode.decode_drop_after_frames = 2  # lost mid-stream, no other decode engine
    decode.decode_drop_reply = True
    async with traced(prefill, decode, exported, policy="disaggregate") as client:
        resp = await client.post(CHAT_PATH, json=chat(stream=stream),
                                 headers={"x-request-id": "lost"})
        if stream:
            assert resp.status_code == 200 and b"upstream_error" in resp.content
        else:
            assert resp.status_code >= 500
    spans = of_request(exported, "lost")
    (root,) = spans["pdserve.request"]
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes["pd.status"] == (502 if stream else resp.status_code)
    assert "pd.status" not in spans["admission"][0].attributes  # the request's, not the stage's
    assert spans["admission"][0].attributes["pd.decode"] == "decode-0"


async def test_a_stream_ended_by_its_deadline_says_so_on_its_root(prefill: FakeEngine,
                                                                  decode: FakeEngine) -> None:
    """Streaming when the whole request's deadline passes: an in-band timeout, and the trace's
    root is an error with the timeout's status (it was left unmarked, as if it had ended
    well)."""
    exported = InMemorySpanExporter()
    decode.stream_tokens = tuple(f" t{i}" for i in range(40))
    decode.decode_frame_interval_s = 0.05  # 2 s for the whole answer; the deadline is 0.5 s
    async with traced(prefill, decode, exported, policy="disaggregate",
                      headers_deadline_s=0.4, total_deadline_s=0.5) as client:
        resp = await client.post(CHAT_PATH, json=chat(max_tokens=40),
                                 headers={"x-request-id": "late"})
        assert resp.status_code == 200 and b"timeout_error" in resp.content
    (root,) = of_request(exported, "late")["pdserve.request"]
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes["pd.status"] == 504
    assert root.attributes["pd.error_type"] == "timeout_error"
