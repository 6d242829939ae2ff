"""Stream migration against fake engines: a decode engine lost mid-answer, the answer continued
on the other, and what the client sees (one stream: its id, every token once, one finish, one
[DONE], usage counting the original prompt once). The fakes answer like a greedy model
(``harness.fake_engine``: a prompt ending in the answer's own ids is continued from there), so
a continuation that drops or repeats a token shows in the text.

The real thing (vLLM engines killed under load) is ``tests/layouts/test_migration_e2e.py`` and
the Ray test ``test_zz_decode_killed_mid_run_streams_continue``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from harness.fake_engine import DONE_FRAME, OUTPUT_ID_BASE, FakeEngine
from proxy.migration import not_migratable
from tests.proxy.test_proxy_app import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    SHORT_S,
    assert_error,
    chat_body,
    completions_body,
    metric,
    proxy,
    sse_events,
)

TOKENS = ("The", " quick", " brown", " fox", " jumps", ".")
TEXT = "".join(TOKENS)


def two_decodes(decode: FakeEngine, decode2: FakeEngine, **overrides: Any):
    return {"decode_urls": (decode.url, decode2.url), **overrides}


def events(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of a stream that ended with ``[DONE]`` (exactly once)."""
    assert raw.endswith(DONE_FRAME) and raw.count(b"[DONE]") == 1, raw
    return [json.loads(e) for e in sse_events(raw[: -len(DONE_FRAME)])]


def text_of(evs: list[dict[str, Any]]) -> str:
    out = []
    for e in evs:
        for c in e["choices"]:
            out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


def finishes(evs: list[dict[str, Any]]) -> list[str]:
    return [c["finish_reason"] for e in evs for c in e["choices"] if c.get("finish_reason")]


@pytest.fixture
def engines(prefill: FakeEngine, decode: FakeEngine, decode2: FakeEngine):
    for e in (decode, decode2):
        e.stream_tokens = TOKENS
    decode.decode_drop_after_frames = 2  # the first decode engine dies after two frames
    return prefill, decode, decode2


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH])
async def test_a_stream_whose_decode_dies_is_continued_on_the_other(engines, path):
    prefill, decode, decode2 = engines
    body = {COMPLETIONS_PATH: completions_body, CHAT_PATH: chat_body}[path](
        stream=True, max_tokens=len(TOKENS), stream_options={"include_usage": True})
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(path, json=body, headers={"x-request-id": "mig-1"})
        assert resp.status_code == 200
        assert await metric(client, "pd_migrations_total", reason="decode_lost") == 1
        assert await metric(client, "pd_stream_errors_total", reason="decode_lost") == 0
    assert len(decode.decode_requests) == len(decode2.decode_requests) == 1
    evs = events(resp.content)
    assert text_of(evs) == TEXT  # every token once, in order
    assert finishes(evs) == ["length"]
    assert {e["id"] for e in evs} == {evs[0]["id"]} and {e["created"] for e in evs} == {
        evs[0]["created"]}
    chat = path == CHAT_PATH
    assert {e["object"] for e in evs} == {"chat.completion.chunk" if chat else "text_completion"}
    assert b"token_ids" not in resp.content  # the ids the proxy asked for are its own
    # The continuation: a completion of the prompt's ids plus the ones relayed (two frames: a
    # chat stream's first is the role), its budget less those.
    relayed = 1 if chat else 2
    cont = decode2.decode_requests[0]
    prompt_ids = prefill.handoff_prompt_ids[0]
    assert cont.path == COMPLETIONS_PATH and cont.request_id == "mig-1"
    assert cont.body["prompt"] == prompt_ids + [OUTPUT_ID_BASE + j for j in range(relayed)]
    assert cont.body["max_tokens"] == len(TOKENS) - relayed and "messages" not in cont.body
    (usage,) = [e["usage"] for e in evs if e.get("usage")]
    assert usage == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(TOKENS),
                     "total_tokens": len(prompt_ids) + len(TOKENS)}


async def test_the_gap_a_migration_adds_is_measured(engines):
    """``pd_migration_seconds``: from the loss to the continuation's headers (resumed) and to
    its first relayed bytes (first_token), here held back 0.3 s by the other engine."""
    prefill, decode, decode2 = engines
    decode2.decode_gate = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        loop.call_later(0.3, decode2.decode_gate.set)
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
        assert text_of(events(resp.content)) == TEXT
        for stage in ("resumed", "first_token"):
            assert await metric(client, "pd_migration_seconds_count", stage=stage) == 1
        resumed = await metric(client, "pd_migration_seconds_sum", stage="resumed")
        first = await metric(client, "pd_migration_seconds_sum", stage="first_token")
    assert 0.25 <= resumed <= first < 5.0


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH])
async def test_an_engine_that_reports_its_own_failure_in_band_is_continued(engines, path):
    """vLLM whose engine core died ends its streams itself: an error event (code 500), then
    ``[DONE]``. Neither reaches the client: the stream goes on on the other engine."""
    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames, decode.decode_error_after_frames = None, 3
    body = {COMPLETIONS_PATH: completions_body, CHAT_PATH: chat_body}[path](
        stream=True, max_tokens=len(TOKENS), stream_options={"include_usage": True})
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(path, json=body)
        assert await metric(client, "pd_migrations_total", reason="decode_error") == 1
        assert await metric(client, "pd_stream_errors_total", reason="decode_error") == 0
    evs = events(resp.content)
    assert b"error" not in resp.content
    assert text_of(evs) == TEXT and finishes(evs) == ["length"]
    assert len(decode2.decode_requests) == 1


async def test_an_in_band_error_of_the_request_itself_is_the_clients(engines):
    """A 4xx error event is about the request: passed through, not continued elsewhere."""
    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames, decode.decode_error_after_frames = None, 3
    decode.decode_error_code = 400
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
        assert await metric(client, "pd_migrations_total", reason="decode_error") == 0
    (error,) = [e for e in events(resp.content) if "error" in e]
    assert error["error"]["code"] == 400
    assert decode2.decode_requests == []


async def test_a_stream_that_cannot_be_continued_keeps_the_engines_in_band_error(engines):
    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames, decode.decode_error_after_frames = None, 3
    body = completions_body(stream=True, logprobs=1)
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=body)
    (error,) = [e for e in events(resp.content) if "error" in e]
    assert error["error"]["code"] == 500
    assert decode2.decode_requests == []


@pytest.mark.parametrize("stream", [True, False])
async def test_a_decode_engine_answering_500_is_replaced_and_the_prompt_computed(engines, stream):
    """vLLM answers 500 to a new request while its engine core is dead (until its server
    exits): the request goes to the other decode engine, which computes the prompt itself (the
    failed engine may have read the hand-off: its blocks may be reused by now)."""
    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames, decode.decode_status = None, 500
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=stream))
        assert resp.status_code == 200
        assert await metric(client, "pd_fallbacks_total", reason="decode_retried") == 1
        assert await metric(client, "pd_fallbacks_total", reason="handoff_maybe_read") == 1
    text = text_of(events(resp.content)) if stream else resp.json()["choices"][0]["text"]
    assert text == TEXT
    assert len(decode.decode_requests) == len(decode2.decode_requests) == 1
    assert "kv_transfer_params" in decode.decode_requests[0].body
    assert "kv_transfer_params" not in decode2.decode_requests[0].body


async def test_with_no_other_decode_engine_a_500_is_an_upstream_error(engines):
    prefill, decode, _ = engines
    decode.decode_drop_after_frames, decode.decode_status = None, 500
    async with proxy(prefill, decode, decode_urls=(decode.url,)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
    assert_error(resp, 502, "upstream_error")


async def test_the_client_that_asked_for_token_ids_gets_each_once(engines):
    prefill, decode, decode2 = engines
    body = completions_body(stream=True, return_token_ids=True)
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=body)
    evs = events(resp.content)
    ids = [i for e in evs for c in e["choices"] for i in c.get("token_ids") or []]
    assert ids == [OUTPUT_ID_BASE + j for j in range(len(TOKENS))]
    prompts = [c["prompt_token_ids"] for e in evs for c in e["choices"]
               if "prompt_token_ids" in c]
    assert prompts == [prefill.handoff_prompt_ids[0]]


async def test_a_stream_whose_decode_goes_silent_is_continued_and_the_silent_one_aborted(
        engines):
    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames = None
    decode.decode_gate, decode.decode_gate_after_frames = asyncio.Event(), 2
    async with proxy(prefill, decode, **two_decodes(decode, decode2, idle_deadline_s=SHORT_S)
                     ) as client:
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
        assert await metric(client, "pd_migrations_total", reason="decode_timeout") == 1
    assert text_of(events(resp.content)) == TEXT
    await asyncio.wait_for(decode.decode_aborted.wait(), 10)


async def test_every_token_out_but_the_end_lost_is_finished_without_another_engine(engines):
    """The finish came, the usage event and [DONE] did not: the proxy ends the stream."""
    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames = 2
    body = completions_body(stream=True, max_tokens=2, stream_options={"include_usage": True})
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=body)
        assert await metric(client, "pd_migrations_total", reason="decode_lost_at_end") == 1
    evs = events(resp.content)
    assert text_of(evs) == "".join(TOKENS[:2]) and finishes(evs) == ["length"]
    assert evs[-1]["usage"]["completion_tokens"] == 2
    assert decode2.decode_requests == []


async def test_a_continuation_that_dies_too_is_continued_again_within_the_limit(
        prefill, decode, decode2):
    third = FakeEngine("decode-3")
    await third.start()
    try:
        for e in (decode, decode2, third):
            e.stream_tokens = TOKENS
        decode.decode_drop_after_frames = 2
        decode2.decode_drop_after_frames = 2  # two more of the answer, then it dies as well
        urls = (decode.url, decode2.url, third.url)
        async with proxy(prefill, decode, decode_urls=urls) as client:
            resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
            assert await metric(client, "pd_migrations_total", reason="decode_lost") == 2
        assert text_of(events(resp.content)) == TEXT
        assert third.decode_requests[0].body["prompt"][-4:] == [
            OUTPUT_ID_BASE + j for j in range(4)]
        # With a limit of 1, the second loss reaches the client as the in-band error.
        for e in (decode, decode2):
            e.decode_drop_after_frames = 2
        async with proxy(prefill, decode, decode_urls=urls, migration_limit=1) as client:
            resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
            assert await metric(client, "pd_migrations_failed_total", reason="limit") == 1
        assert b'"upstream_error"' in resp.content
    finally:
        await third.stop()


async def test_with_no_other_decode_engine_the_stream_ends_with_the_in_band_error(
        prefill, decode):
    decode.decode_drop_after_frames = 2
    async with proxy(prefill, decode) as client:
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
        assert await metric(client, "pd_migrations_failed_total", reason="no_engine") == 1
        assert await metric(client, "pd_stream_errors_total", reason="decode_lost") == 1
    assert b'"upstream_error"' in resp.content and resp.content.endswith(DONE_FRAME)


@pytest.mark.parametrize("extra, why", [
    ({"logprobs": 1}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"prompt": ["one", "two"]}, "batch"),
    ({"stop": ["\n"]}, "stop_strings"),
    ({"response_format": {"type": "json_object"}}, "structured_output"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_output"),
])
async def test_what_cannot_be_continued_exactly_keeps_the_in_band_error(engines, extra, why):
    prefill, decode, decode2 = engines
    assert not_migratable(completions_body(**extra)) == why
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True, **extra))
        assert await metric(client, "pd_migrations_failed_total", reason=why) == 1
    assert b'"upstream_error"' in resp.content
    assert "return_token_ids" not in decode.decode_requests[0].body  # nothing asked for
    assert decode2.decode_requests == []


@pytest.mark.parametrize("extra", [{"temperature": 1.0}, {"temperature": 0.8, "seed": 7},
                                   {"frequency_penalty": 0.5}])
async def test_sampled_answers_are_continued_with_the_same_parameters(engines, extra):
    """Continued, though not what an uninterrupted run would have sent (the README says so):
    the continuation carries the client's sampling parameters, seed included."""
    prefill, decode, decode2 = engines
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(CHAT_PATH, json=chat_body(stream=True, **extra))
        assert await metric(client, "pd_migrations_total", reason="decode_lost") == 1
    assert text_of(events(resp.content)) == TEXT
    cont = decode2.decode_requests[0].body
    assert {k: cont[k] for k in extra} == extra


async def test_a_whole_reply_lost_mid_answer_is_asked_again_on_the_other(engines):
    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames, decode.decode_drop_reply = None, True
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=completions_body())
        assert await metric(client, "pd_migrations_total", reason="decode_lost") == 1
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == TEXT
    assert len(decode2.decode_requests) == 1


async def test_nothing_is_left_outstanding_after_a_migration(engines):
    prefill, decode, decode2 = engines
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
        assert text_of(events(resp.content)) == TEXT
        state = client._transport.app.state.pd  # type: ignore[attr-defined]
        loads = state.orchestrator.ledger.loads()
        assert all(v.prompt_tokens == v.output_tokens == v.requests == 0
                   for v in loads.values()), loads


@pytest.mark.parametrize("path, max_model_len, want", [
    (COMPLETIONS_PATH, None, 16 - 2),  # vLLM's default for a completion: 16
    (CHAT_PATH, 4096, "context"),  # a chat answer may fill the context
    (CHAT_PATH, None, None),  # unknown: not continued
])
async def test_a_request_without_max_tokens_keeps_its_budget(engines, path, max_model_len, want):
    prefill, decode, decode2 = engines
    body = {COMPLETIONS_PATH: completions_body, CHAT_PATH: chat_body}[path](stream=True)
    del body["max_tokens"]
    async with proxy(prefill, decode, **two_decodes(decode, decode2,
                                                    max_model_len=max_model_len)) as client:
        resp = await client.post(path, json=body)
        failed = await metric(client, "pd_migrations_failed_total", reason="unknown_budget")
    if want is None:
        assert failed == 1 and b'"upstream_error"' in resp.content
        return
    cont = decode2.decode_requests[0].body
    if want == "context":
        want = max_model_len - len(cont["prompt"])  # the original prompt + the one relayed
    assert cont["max_tokens"] == want and "max_completion_tokens" not in cont
    assert text_of(events(resp.content)) == TEXT


async def test_the_whole_request_deadline_ends_a_stream_and_is_never_continued(engines):
    """A stream still going at ``total_deadline_s`` (its engine fine, only slow) ends with an
    in-band timeout: it is not a lost engine, so no continuation gets a fresh deadline."""
    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames = None
    decode.stream_tokens = tuple(f" t{i}" for i in range(40))
    decode.decode_frame_interval_s = 0.05  # 2 s for the whole answer; the deadline is 0.5 s
    async with proxy(prefill, decode, **two_decodes(
            decode, decode2, headers_deadline_s=0.4, total_deadline_s=0.5)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(
            stream=True, max_tokens=40))
        await asyncio.wait_for(decode.decode_aborted.wait(), 5)
        assert await metric(client, "pd_stream_errors_total", reason="deadline") == 1
        assert await metric(client, "pd_migrations_total", reason="decode_timeout") == 0
    assert resp.status_code == 200
    *tokens, error = events(resp.content)
    assert error["error"]["type"] == "timeout_error", error
    assert 0 < len(tokens) < 40
    assert decode2.decode_requests == []


async def test_a_stream_dropped_before_its_first_read_closes_its_decode_and_claim(engines):
    """The client hangs up while the response headers are being written, so the stream is
    never read: its decode request must still be closed (the engine aborts it) and the
    request's claim released (``Stream.abandon``; closing a generator that never started runs
    none of its cleanup)."""
    from proxy.render import render
    from proxy.requests import ApiRequest

    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames = None
    # The engine answers with its headers and one frame, then holds the stream open.
    decode.decode_gate, decode.decode_gate_after_frames = asyncio.Event(), 1
    gone = asyncio.Event()

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            gone.set()
            await asyncio.Event().wait()  # a client that stopped reading

    async with proxy(prefill, decode, decode_urls=(decode.url,)) as client:
        state = client._transport.app.state.pd  # type: ignore[attr-defined]
        req = ApiRequest("completions", completions_body(stream=True), True, "dropped")
        stream = await state.orchestrator.serve(req)
        await asyncio.wait_for(render(stream)({"type": "http"}, receive, send), 10)
        await asyncio.wait_for(decode.decode_aborted.wait(), 10)
        loads = state.orchestrator.ledger.loads()
        assert all(v.prompt_tokens == v.output_tokens == v.requests == 0
                   for v in loads.values()), loads


async def test_a_stream_lost_after_its_usage_event_gets_no_second_one(engines):
    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames = len(TOKENS) + 1  # every token and usage; no [DONE]
    body = completions_body(stream=True, max_tokens=len(TOKENS),
                            stream_options={"include_usage": True})
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(COMPLETIONS_PATH, json=body)
    evs = events(resp.content)
    assert text_of(evs) == TEXT
    assert len([e for e in evs if e.get("usage")]) == 1


async def test_a_chat_stream_lost_after_its_role_event_says_the_role_once(engines):
    prefill, decode, decode2 = engines
    decode.decode_drop_after_frames = 1  # the role event only
    async with proxy(prefill, decode, **two_decodes(decode, decode2)) as client:
        resp = await client.post(CHAT_PATH, json=chat_body(stream=True, max_tokens=len(TOKENS)))
    evs = events(resp.content)
    assert text_of(evs) == TEXT
    assert len([e for e in evs if "role" in e["choices"][0].get("delta", {})]) == 1


async def test_a_continuation_that_fails_before_answering_is_tried_on_another(engines):
    prefill, decode, decode2 = engines
    third = FakeEngine("decode-3")
    await third.start()
    try:
        third.stream_tokens = TOKENS
        decode2.decode_gate = asyncio.Event()  # never answers: past the headers deadline
        urls = (decode.url, decode2.url, third.url)
        async with proxy(prefill, decode, decode_urls=urls, headers_deadline_s=0.3) as client:
            resp = await client.post(COMPLETIONS_PATH, json=completions_body(
                stream=True, max_tokens=len(TOKENS)))
            assert await metric(client, "pd_migrations_total", reason="decode_lost") == 2
        assert text_of(events(resp.content)) == TEXT
        assert len(third.decode_requests) == 1
    finally:
        decode2.decode_gate.set()
        await third.stop()


def test_every_reason_a_stream_may_end_with_its_error_has_a_series_from_the_start():
    """Read 0, not "no data", before the first failure of its kind (as ``metrics.py``
    promises): a stream past the request's deadline, and each reason a stream is not
    continued (those ``not_migratable`` gives, taken from it here)."""
    from proxy.metrics import ProxyMetrics

    registry = ProxyMetrics().registry
    assert registry.get_sample_value("pd_stream_errors_total", {"reason": "deadline"}) == 0
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    not_exact = {not_migratable(body) for body in (
        {"logprobs": 1}, {"echo": True}, {"stop": ["\n"]}, {"tools": [{}]},
        {"messages": [{"role": "user", "content": [image]}]})}
    for reason in not_exact | {"disabled", "limit", "unknown_budget", "unknown_prompt",
                               "no_engine"}:
        assert registry.get_sample_value("pd_migrations_failed_total",
                                         {"reason": reason}) == 0, reason
