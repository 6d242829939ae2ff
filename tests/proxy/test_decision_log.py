"""``GET /pd/decisions``: the latest routing decisions, each with what came of it."""

from __future__ import annotations

from dataclasses import dataclass

from harness.fake_engine import FakeEngine
from proxy.decision_log import DecisionLog
from proxy.plan import Plan
from proxy.policy import Decision, Targets
from proxy.trace import Trace
from tests.proxy.test_proxy_app import CHAT_PATH, assert_error, chat_body, proxy


@dataclass
class Named:
    name: str


def plan(route: str = "local") -> Plan:
    decision = Decision(route, "slo_fastest", 0.5, 0.25, 0.03, 0.2, stall_room=2, streams=3,
                        ttft_correction=(1.0, 1.25))
    return Plan(decision, Named("p0"), Named("d0"), 400, 100, 36, 16,  # type: ignore[arg-type]
                Targets(itl_s=0.05))


def test_the_log_keeps_the_newest_and_finds_by_id_or_prefix():
    log = DecisionLog(capacity=3)
    for i in range(5):
        log.record(f"run-{i}", "auto", plan())
    assert [e["request_id"] for e in log.recent(10)] == ["run-4", "run-3", "run-2"]
    assert [e["request_id"] for e in log.recent(2)] == ["run-4", "run-3"]
    assert [e["request_id"] for e in log.recent(10, request_id="run-3")] == ["run-3"]
    assert log.recent(10, request_id="run-0") == []  # dropped
    log.record("other", "auto", plan())
    assert [e["request_id"] for e in log.recent(10, prefix="run-")] == ["run-4", "run-3"]


def test_an_entry_says_what_was_decided_and_what_came_of_it():
    log = DecisionLog()
    entry = log.record("r1", "auto", plan("disaggregated"))
    (view,) = log.recent(1)
    assert view | {"at": 0} == {
        "request_id": "r1", "at": 0, "policy": "auto", "route": "disaggregated",
        "reason": "slo_fastest", "prefill": "p0", "decode": "d0", "prompt_tokens": 100,
        "decode_cached_tokens": 36, "streams": 3, "stall_room": 2, "stalls": 0,
        "targets_ms": {"ttft": None, "itl": 50.0},
        "predicted_ttft_ms": {"disaggregated": 500.0, "local": 250.0},
        "ttft_correction": {"disaggregated": 1.0, "local": 1.25},
        "predicted_gap_ms": {"disaggregated": 30.0, "local": 200.0, "prefill_engine": None},
        "route_taken": None, "ttft_ms": None}
    trace = Trace(t_start=10.0)
    entry.taken("local", trace)  # the prefill failed: computed on the decode engine
    assert log.recent(1)[0]["ttft_ms"] is None  # answered, no bytes to the client yet
    trace.t_first = 10.4
    assert log.recent(1)[0] == view | {"route_taken": "local", "ttft_ms": 400.0}


async def test_the_route_shows_each_requests_decision(prefill: FakeEngine, decode: FakeEngine):
    async with proxy(prefill, decode, policy="threshold:1000") as client:
        for rid, stream in (("bench-0", True), ("bench-1", False), ("other", False)):
            r = await client.post(CHAT_PATH, json=chat_body(stream=stream),
                                  headers={"x-request-id": rid})
            assert r.status_code == 200
        got = (await client.get("/pd/decisions", params={"prefix": "bench-"})).json()
        assert [d["request_id"] for d in got["decisions"]] == ["bench-1", "bench-0"]
        streamed = got["decisions"][1]
        assert (streamed["route"], streamed["reason"]) == ("local", "under_threshold")
        assert streamed["route_taken"] == "local" and streamed["ttft_ms"] > 0
        assert streamed["policy"] == "threshold:1000" and streamed["prompt_tokens"] > 0
        one = (await client.get("/pd/decisions", params={"request_id": "other"})).json()
        assert [d["request_id"] for d in one["decisions"]] == ["other"]
        for bad in ("0", "-1", "x", "\u00b2"):  # (a digit to str.isdigit, not to int)
            assert_error(await client.get("/pd/decisions", params={"limit": bad}), 400,
                         "invalid_request_error", "limit")


async def test_the_route_is_an_ops_route(prefill: FakeEngine, decode: FakeEngine):
    async with proxy(prefill, decode, api_key="sekret", public_health=False) as client:
        assert_error(await client.get("/pd/decisions"), 401, "authentication_error")
        good = {"authorization": "Bearer sekret"}
        assert (await client.get("/pd/decisions", headers=good)).status_code == 200
