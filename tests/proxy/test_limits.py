"""Admission control and request-body limits, in front of fake engines.

Admission runs with ``max_inflight=2, max_queued=1``: requests are held in flight by decode
streams that send one frame and then hang on an event, so every slot is taken or freed exactly
when the test says. A slot must come back however the stream ends: normally, with an in-band
error, or by the client hanging up; the proof is two more streams being served side by side.
These tests run the app under uvicorn (``live_proxy``) so that streams are really open and clients
really hang up. Body-size limits use the in-process transport; the slow-body guard needs a raw
socket that stops sending halfway.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from test_proxy_app import CHAT_PATH, assert_error, chat_body, proxy, split_in_band_error

from harness.fake_engine import DONE_FRAME, FakeEngine
from harness.live_proxy import SETTLE_S, LiveProxy, RawRequest, live_proxy, proxy_config, wait_until

LIMITS: dict[str, Any] = {"max_inflight": 2, "max_queued": 1, "queue_timeout_s": 0.5}
#: A queue timeout no step of a test comes near: only a freed slot lets a queued request in.
PATIENT_QUEUE_S = 300.0


def stream_body() -> dict[str, Any]:
    return chat_body(stream=True)


async def stream_chat(client: httpx.AsyncClient, first_frame: asyncio.Event | None = None
                      ) -> tuple[httpx.Response, bytes]:
    """One streamed chat request read to its end; ``first_frame`` is set once an event arrived."""
    async with client.stream("POST", CHAT_PATH, json=stream_body()) as resp:
        body = b""
        async for chunk in resp.aiter_raw():
            body += chunk
            if first_frame is not None and b"\n\n" in body:
                first_frame.set()
    return resp, body


async def start_held_stream(client: httpx.AsyncClient, decode: FakeEngine, gate: asyncio.Event
                            ) -> asyncio.Task[tuple[httpx.Response, bytes]]:
    """Start a stream that decode holds after one frame until ``gate``; return once it streams."""
    decode.decode_gate = gate
    decode.decode_gate_after_frames = 1
    first = asyncio.Event()
    task = asyncio.create_task(stream_chat(client, first))
    async with asyncio.timeout(SETTLE_S):
        await first.wait()
    return task


def assert_completed(result: tuple[httpx.Response, bytes]) -> None:
    resp, body = result
    assert resp.status_code == 200, body
    assert resp.headers["x-pd-route"] == "disaggregated"
    assert body.endswith(DONE_FRAME) and b'"error"' not in body, body


def assert_overloaded(resp: httpx.Response) -> None:
    assert_error(resp, 503, "overloaded_error")
    assert int(resp.headers["retry-after"]) >= 1


async def assert_two_slots_free(client: httpx.AsyncClient, decode: FakeEngine) -> None:
    """Two streams are served side by side (neither waits in the queue), then both finish."""
    gate = asyncio.Event()
    held = [await start_held_stream(client, decode, gate) for _ in range(2)]
    gate.set()
    for task in held:
        assert_completed(await task)


@pytest.fixture
async def client_for() -> AsyncIterator[Any]:
    clients: list[httpx.AsyncClient] = []

    def make(lp: LiveProxy) -> httpx.AsyncClient:
        clients.append(httpx.AsyncClient(base_url=lp.url, timeout=SETTLE_S * 2))
        return clients[-1]

    yield make
    for c in clients:
        await c.aclose()


# --- admission ----------------------------------------------------------------------------------


async def test_full_queue_is_refused_at_once_and_the_queued_request_gets_the_next_slot(
    prefill: FakeEngine, decode: FakeEngine, client_for: Any
) -> None:
    config = proxy_config(prefill, decode, **LIMITS | {"queue_timeout_s": PATIENT_QUEUE_S})
    async with live_proxy(config) as lp:
        client = client_for(lp)
        gate_a, gate_b = asyncio.Event(), asyncio.Event()
        stream_a = await start_held_stream(client, decode, gate_a)
        stream_b = await start_held_stream(client, decode, gate_b)
        decode.decode_gate = None  # whatever comes next streams straight through
        queued = asyncio.create_task(stream_chat(client))
        await wait_until(lambda: lp.state.admission.queued == 1, "the third request is queued")
        assert len(prefill.prefill_requests) == 2  # queued: no engine has seen it

        # The fourth finds the queue full: refused at once (not after the queue timeout).
        async with asyncio.timeout(SETTLE_S):
            fourth = await client.post(CHAT_PATH, json=stream_body())
        assert_overloaded(fourth)
        assert fourth.headers["retry-after"] == "1"
        assert lp.state.admission.queued == 1 and not queued.done()
        assert lp.metric("pd_rejected_total", type="overloaded_error") == 1

        gate_a.set()  # one slot frees: the queued request takes it and is served
        assert_completed(await stream_a)
        async with asyncio.timeout(SETTLE_S):
            assert_completed(await queued)
        assert not stream_b.done()  # it still holds the other slot
        gate_b.set()
        assert_completed(await stream_b)

        assert len(prefill.prefill_requests) == len(decode.decode_requests) == 3
        assert lp.state.admission.inflight == 0
        assert not any(lp.outstanding_tokens().values()), lp.outstanding_tokens()
        assert lp.metric("pd_inflight_requests") == 0


async def test_queued_request_gives_up_after_the_queue_timeout(
    prefill: FakeEngine, decode: FakeEngine, client_for: Any
) -> None:
    async with live_proxy(proxy_config(prefill, decode, **LIMITS)) as lp:
        client = client_for(lp)
        gate = asyncio.Event()
        held = [await start_held_stream(client, decode, gate) for _ in range(2)]
        t0 = time.perf_counter()
        resp = await client.post(CHAT_PATH, json=stream_body())
        waited_s = time.perf_counter() - t0
        assert_overloaded(resp)
        assert waited_s >= LIMITS["queue_timeout_s"] * 0.9  # it did wait in the queue
        assert lp.metric("pd_rejected_total", type="overloaded_error") == 1
        assert lp.state.admission.queued == 0
        assert len(prefill.prefill_requests) == 2
        gate.set()
        for task in held:
            assert_completed(await task)
        await assert_two_slots_free(client, decode)


async def test_slots_come_back_when_streams_end_normally(
    prefill: FakeEngine, decode: FakeEngine, client_for: Any
) -> None:
    async with live_proxy(proxy_config(prefill, decode, **LIMITS)) as lp:
        client = client_for(lp)
        for result in await asyncio.gather(stream_chat(client), stream_chat(client)):
            assert_completed(result)
        assert lp.state.admission.inflight == 0
        assert not any(lp.outstanding_tokens().values()), lp.outstanding_tokens()
        await assert_two_slots_free(client, decode)
        assert lp.metric("pd_inflight_requests") == 0


async def test_slots_come_back_after_in_band_errors(
    prefill: FakeEngine, decode: FakeEngine, client_for: Any
) -> None:
    decode.decode_drop_after_frames = 2  # decode dies mid-stream
    async with live_proxy(proxy_config(prefill, decode, **LIMITS)) as lp:
        client = client_for(lp)
        for resp, body in await asyncio.gather(stream_chat(client), stream_chat(client)):
            assert resp.status_code == 200
            _, error = split_in_band_error(body)
            assert error["type"] == "upstream_error"
        assert lp.metric("pd_stream_errors_total", reason="decode_lost") == 2
        assert lp.state.admission.inflight == 0
        assert not any(lp.outstanding_tokens().values()), lp.outstanding_tokens()
        decode.decode_drop_after_frames = None
        # The drop marked decode down; the next probe finds it up again.
        assert await lp.state.pool.probe(lp.state.pool.decode[0])
        await assert_two_slots_free(client, decode)


async def test_slots_come_back_when_clients_hang_up_mid_stream(
    prefill: FakeEngine, decode: FakeEngine, client_for: Any
) -> None:
    decode.decode_gate = asyncio.Event()  # never set: the streams stay open until clients leave
    decode.decode_gate_after_frames = 1
    async with live_proxy(proxy_config(prefill, decode, **LIMITS)) as lp:
        raws = [await RawRequest.send(lp, CHAT_PATH, stream_body()) for _ in range(2)]
        for raw in raws:
            await raw.read_until(b"data: ")  # the stream is open and relaying
        assert lp.state.admission.inflight == 2
        for raw in raws:
            await raw.hang_up()
        await lp.wait_for_metric("pd_inflight_requests", 0)
        await lp.wait_for_metric("pd_client_disconnects_total", 2, stage="streaming")
        assert lp.state.admission.inflight == 0
        assert not any(lp.outstanding_tokens().values()), lp.outstanding_tokens()
        await assert_two_slots_free(client_for(lp), decode)


# --- body limits --------------------------------------------------------------------------------

BODY_LIMIT_BYTES = 1024


async def test_declared_length_over_the_limit_is_413(prefill: FakeEngine, decode: FakeEngine
                                                     ) -> None:
    raw = json.dumps(chat_body(pad="x" * 4 * BODY_LIMIT_BYTES)).encode()
    async with proxy(prefill, decode, body_limit_bytes=BODY_LIMIT_BYTES) as client:
        resp = await client.post(CHAT_PATH, content=raw,
                                 headers={"content-type": "application/json"})
        assert resp.request.headers["content-length"] == str(len(raw))
        assert_error(resp, 413, "invalid_request_error")
    assert not prefill.completion_requests and not decode.completion_requests


async def test_chunked_body_over_the_limit_is_413_without_reading_it_all(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    piece = b" " * 256
    pieces_sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pieces_sent
        for i in range(200):  # 50 KiB in all, if anyone read it
            pieces_sent += 1
            yield b'{"model": "m", "pad": "' if i == 0 else piece

    async with proxy(prefill, decode, body_limit_bytes=BODY_LIMIT_BYTES) as client:
        resp = await client.post(CHAT_PATH, content=body(),
                                 headers={"content-type": "application/json"})
        assert "content-length" not in resp.request.headers  # chunked: no size declared
        assert_error(resp, 413, "invalid_request_error")
    assert pieces_sent * len(piece) < 2 * BODY_LIMIT_BYTES  # stopped soon after the limit
    assert not prefill.completion_requests and not decode.completion_requests


async def test_huge_declared_length_is_413_before_any_body_arrives(
    prefill: FakeEngine, decode: FakeEngine
) -> None:
    """Refused on the header alone: the answer comes long before the body-read deadline."""
    config = proxy_config(prefill, decode, body_limit_bytes=BODY_LIMIT_BYTES,
                          body_read_deadline_s=PATIENT_QUEUE_S)
    async with live_proxy(config) as lp:
        raw = await RawRequest.send(lp, CHAT_PATH, b"", content_length=10 * 1024 * 1024)
        assert await raw.status() == 413
        _, body = await raw.head_and_body()
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        await raw.hang_up()
    assert not prefill.completion_requests and not decode.completion_requests


async def test_slow_body_gets_408(prefill: FakeEngine, decode: FakeEngine) -> None:
    """A client that stops sending halfway (slow loris) is answered 408 at the deadline."""
    config = proxy_config(prefill, decode, body_read_deadline_s=0.5)
    async with live_proxy(config) as lp:
        t0 = time.perf_counter()
        raw = await RawRequest.send(lp, CHAT_PATH, b'{"model": ', content_length=100)
        assert await raw.status(timeout_s=2.0) == 408
        assert time.perf_counter() - t0 >= 0.45  # it did wait for the rest
        _, body = await raw.head_and_body()
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        await raw.hang_up()
        assert lp.metric("pd_rejected_total", type="invalid_request_error") == 1
        assert lp.state.admission.inflight == 0
        assert not any(lp.outstanding_tokens().values()), lp.outstanding_tokens()
    assert not prefill.completion_requests and not decode.completion_requests


async def _open(lp) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(lp.host, lp.port)


async def test_slow_headers_get_408_and_a_closed_connection(prefill, decode) -> None:
    """Slow loris on the headers (the app never sees the request): 408 at the deadline, the
    connection closed, no engine called."""
    config = proxy_config(prefill, decode, header_read_deadline_s=0.5)
    async with live_proxy(config) as lp:
        reader, writer = await _open(lp)
        t0 = time.perf_counter()
        writer.write(f"POST {CHAT_PATH} HTTP/1.1\r\nhost: x\r\ncontent-ty".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=5)  # until the proxy closes
        assert time.perf_counter() - t0 >= 0.45
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and "headers" in error["message"]
        writer.close()
        # A connection that sends nothing at all is closed too.
        reader, writer = await _open(lp)
        assert (await asyncio.wait_for(reader.read(), timeout=5)).startswith(b"HTTP/1.1 408 ")
        writer.close()
    assert not prefill.completion_requests and not decode.completion_requests


async def test_oversized_headers_get_431_and_a_closed_connection(prefill, decode) -> None:
    """A request head that keeps growing past the cap (32 KiB) is refused with an OpenAI-style
    431 before it completes; a large body after a normal head is not a large head."""
    async with live_proxy(proxy_config(prefill, decode)) as lp:
        reader, writer = await _open(lp)
        writer.write(f"POST {CHAT_PATH} HTTP/1.1\r\nhost: x\r\n".encode())
        # 32 headers of ~1 KiB, never finished: the last one takes the head over 32 KiB.
        # (Sending on after the refusal would make the closed socket reset the connection.)
        for i in range(32):
            writer.write(f"x-pad-{i}: {'a' * 1024}\r\n".encode())
            await writer.drain()
            await asyncio.sleep(0.005)
        answer = await asyncio.wait_for(reader.read(), timeout=5)  # until the proxy closes
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 ")
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and "headers" in error["message"]
        writer.close()
        async with httpx.AsyncClient() as c:  # a 60 KiB body in one write is fine
            r = await c.post(lp.url + CHAT_PATH, json=chat_body(stream=True, pad="y" * 60_000), timeout=30)
        assert r.status_code == 200
    assert len(prefill.completion_requests) == 1  # the 60 KiB one; the 431 reached no engine


async def test_header_deadline_spares_slow_answers_and_keep_alive(prefill, decode) -> None:
    """The deadline covers only the time to send headers: a request whose answer takes longer,
    and a second request on the same keep-alive connection, are served normally."""
    config = proxy_config(prefill, decode, header_read_deadline_s=0.5)
    async with live_proxy(config) as lp, httpx.AsyncClient() as c:
        prefill.prefill_gate = asyncio.Event()
        slow = asyncio.create_task(c.post(lp.url + CHAT_PATH, json=stream_body(), timeout=30))
        await prefill.wait_for_requests(1)
        await asyncio.sleep(1.0)  # twice the header deadline, inside the request
        prefill.prefill_gate.set()
        assert (await slow).status_code == 200
        await asyncio.sleep(0.8)  # idle on the kept-alive connection: keep-alive rules, not 408
        r = await c.post(lp.url + CHAT_PATH, json=stream_body(), timeout=30)
        assert r.status_code == 200
