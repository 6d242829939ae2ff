"""A client that hangs up, at each stage of a request: what the proxy does to the engines.

The app runs under uvicorn (``live_proxy``) and clients are raw sockets, so a hang-up is a real
closed connection. The fakes record when the proxy closes its connection to them (aiohttp
cancels their handler: vLLM aborts the request the same way). Every wait is on an event or a
short poll of a counter with a deadline.

- before the response, prefill running: the prefill request is aborted, decode is never called;
- after prefill, decode not answering yet: decode is sent a one-token non-streamed "release" with
  the same KV params, so it reads prefill's blocks and prefill frees them (else they are held
  until prefill's lease expires);
- mid-stream: the decode stream is aborted at once;
- while still sending the body: nothing reaches the engines, and it is counted, not a 500.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from test_proxy_app import CHAT_PATH, chat_body

from harness.fake_engine import FakeEngine
from harness.live_proxy import SETTLE_S, LiveProxy, RawRequest, live_proxy, proxy_config, wait_until
from proxy.app import create_app

#: How soon the proxy must pass a hang-up on to the engine it is waiting for.
NOTICE_S = 1.0
STAGES = ("before_response", "after_prefill", "streaming")


def disconnects(lp: LiveProxy) -> dict[str, float]:
    return {stage: lp.metric("pd_client_disconnects_total", stage=stage) for stage in STAGES}


async def assert_slot_released(lp: LiveProxy) -> None:
    await lp.wait_for_metric("pd_inflight_requests", 0)
    assert lp.state.admission.inflight == 0
    await wait_until(lambda: not any(lp.outstanding_tokens().values()),
                     f"no routing load left: {lp.outstanding_tokens()}")


async def hang_up_while_waiting(lp: LiveProxy, body: dict, engine: FakeEngine,
                               aborted: asyncio.Event) -> None:
    """The client hangs up once ``engine`` has its request (and holds it); the engine's
    request is aborted within ``NOTICE_S``."""
    raw = await RawRequest.send(lp, CHAT_PATH, body)
    async with asyncio.timeout(SETTLE_S):
        await engine.wait_for_requests(1)
    await raw.hang_up()
    async with asyncio.timeout(NOTICE_S):
        await aborted.wait()


@pytest.mark.parametrize("stream", [True, False])
async def test_hang_up_during_prefill_aborts_it_and_never_calls_decode(
    prefill: FakeEngine, decode: FakeEngine, stream: bool
) -> None:
    prefill.prefill_gate = asyncio.Event()  # never set: prefill hangs until the proxy leaves
    async with live_proxy(proxy_config(prefill, decode)) as lp:
        await hang_up_while_waiting(lp, chat_body(stream=stream), prefill,
                                    prefill.prefill_aborted)
        await lp.wait_for_metric("pd_client_disconnects_total", 1, stage="before_response")
        await assert_slot_released(lp)
        assert disconnects(lp) == {"before_response": 1, "after_prefill": 0, "streaming": 0}
    assert prefill.prefill_aborts == 1
    assert not decode.completion_requests


async def test_hang_up_before_a_whole_reply_answers_reads_no_hand_off_again(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    """vLLM sends a whole reply's headers with its last token: the engine may have pulled the
    KV long before, and the prefill engine freed those blocks. Read again, they would be
    garbage in the decode engine's prefix cache. The decode request is aborted (vLLM frees a
    hand-off it had not scheduled yet), and nothing else is sent."""
    decode.decode_gate = asyncio.Event()
    async with live_proxy(proxy_config(prefill, decode)) as lp:
        await hang_up_while_waiting(lp, chat_body(max_completion_tokens=64), decode,
                                    decode.decode_aborted)
        await lp.wait_for_metric("pd_client_disconnects_total", 1, stage="after_prefill")
        await assert_slot_released(lp)
        await asyncio.sleep(0.2)
        assert not lp.state.orchestrator._background
    assert len(decode.decode_requests) == 1


async def test_hang_up_before_decode_answers_releases_prefill_blocks(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    stream = True
    decode.decode_gate = gate = asyncio.Event()  # decode holds back even its response headers
    body = chat_body(stream=stream, max_completion_tokens=64,
                     **({"stream_options": {"include_usage": True}} if stream else {}))
    async with live_proxy(proxy_config(prefill, decode)) as lp:
        raw = await RawRequest.send(lp, CHAT_PATH, body)
        async with asyncio.timeout(SETTLE_S):
            await decode.wait_for_requests(1)
        await raw.hang_up()
        async with asyncio.timeout(NOTICE_S):
            await decode.decode_aborted.wait()  # the client's decode request is aborted ...
            await decode.wait_for_requests(2)  # ... and the release is sent in its place
        original, release = decode.decode_requests
        assert release.body["max_tokens"] == 1
        assert release.body["stream"] is False
        assert "max_completion_tokens" not in release.body
        assert "stream_options" not in release.body
        assert release.body["kv_transfer_params"] == original.body["kv_transfer_params"]
        assert release.body["messages"] == original.body["messages"]
        assert release.request_id == original.request_id
        gate.set()  # the release is answered (one token, discarded)
        await lp.wait_for_metric("pd_client_disconnects_total", 1, stage="after_prefill")
        await assert_slot_released(lp)
        assert disconnects(lp) == {"before_response": 0, "after_prefill": 1, "streaming": 0}
        await wait_until(lambda: not lp.state.orchestrator._background, "the release finished")
    assert len(prefill.prefill_requests) == 1
    assert decode.decode_aborts == 1  # the original only: the release ran to its end


async def test_hang_up_mid_stream_aborts_decode_at_once(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    decode.decode_gate = asyncio.Event()  # never set: decode stalls after two frames
    decode.decode_gate_after_frames = 2
    async with live_proxy(proxy_config(prefill, decode)) as lp:
        raw = await RawRequest.send(lp, CHAT_PATH, chat_body(stream=True))
        await raw.read_until(b"data: ")  # streaming: the first frame reached the client
        await raw.hang_up()
        async with asyncio.timeout(NOTICE_S):
            await decode.decode_aborted.wait()
        await lp.wait_for_metric("pd_client_disconnects_total", 1, stage="streaming")
        await assert_slot_released(lp)
        assert disconnects(lp) == {"before_response": 0, "after_prefill": 0, "streaming": 1}
        assert lp.metric("pd_stream_errors_total", reason="decode_lost") == 0
    assert len(decode.decode_requests) == 1  # no release: decode had the request all along
    assert decode.decode_aborts == 1


async def test_hang_up_while_sending_the_body_is_counted_not_a_500(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    async with live_proxy(proxy_config(prefill, decode)) as lp:
        raw = await RawRequest.send(lp, CHAT_PATH, b'{"model": "m", ', content_length=200)
        await raw.hang_up()
        await lp.wait_for_metric("pd_client_disconnects_total", 1, stage="before_response")
        assert lp.state.admission.inflight == 0
        assert lp.metric("pd_inflight_requests") == 0
    assert not prefill.completion_requests and not decode.completion_requests


async def test_hang_up_between_decode_headers_and_the_first_byte(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    """The client leaves after the orchestrator returned the stream, before a byte was sent.

    Needs an ASGI ``receive`` no socket can be timed to give: the body, then nothing while the
    request is served (the proxy's disconnect watcher), then ``http.disconnect`` at once for the
    response's own listener. The stream's cleanup (decode closed, slot back) must still run.
    """
    decode.decode_gate = asyncio.Event()  # never set: decode holds the stream after one frame
    decode.decode_gate_after_frames = 1
    app = create_app(proxy_config(prefill, decode))
    body = json.dumps(chat_body(stream=True)).encode()
    calls = 0

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        if calls == 2:
            await asyncio.Event().wait()  # the watcher: cancelled when the stream is returned
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": CHAT_PATH, "raw_path": CHAT_PATH.encode(),
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 12345),
        "headers": [(b"host", b"proxy"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }
    async with app.router.lifespan_context(app):
        state = app.state.pd
        async with asyncio.timeout(SETTLE_S):
            await app(scope, receive, send)
        async with asyncio.timeout(NOTICE_S):
            await decode.decode_aborted.wait()
        assert state.admission.inflight == 0
        assert state.metrics.registry.get_sample_value("pd_inflight_requests") == 0
        assert state.pool.decode[0].inflight == 0
    assert calls >= 3
