"""``serve_unless_disconnected``: the work runs in the caller's task; a hang-up cancels it and
becomes ClientGone; any other cancellation (server shutdown) stays a cancellation."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest

from proxy.client_io import ClientGone, HangUpCancels, serve_unless_disconnected


class FakeRequest:
    """Just ``receive()``: blocks until ``hang_up()``, then reports the disconnect."""

    def __init__(self) -> None:
        self._gone = asyncio.Event()

    def hang_up(self) -> None:
        self._gone.set()

    async def receive(self) -> dict:
        await self._gone.wait()
        return {"type": "http.disconnect"}


async def test_the_work_runs_in_the_callers_task_and_its_result_comes_back() -> None:
    caller = asyncio.current_task()

    async def work() -> asyncio.Task | None:
        await asyncio.sleep(0)
        return asyncio.current_task()

    assert await serve_unless_disconnected(FakeRequest(), work()) is caller
    await asyncio.sleep(0)
    assert caller.cancelling() == 0


async def test_a_hang_up_cancels_the_work_and_raises_client_gone() -> None:
    request = FakeRequest()
    started, cleaned_up = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            cleaned_up.set()

    async def hang_up_once_started() -> None:
        await started.wait()
        request.hang_up()

    hanger = asyncio.create_task(hang_up_once_started())
    with pytest.raises(ClientGone):
        await asyncio.wait_for(serve_unless_disconnected(request, work()), timeout=5)
    assert cleaned_up.is_set()
    await hanger


async def test_a_shutdown_cancel_is_not_mistaken_for_a_hang_up() -> None:
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(serve_unless_disconnected(FakeRequest(), work()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# --- the SSE response (proxy/render.py's EventStream) ---------------------------------------


class Chunks:
    """An SSE body that yields ``n`` events then waits; records whether it was closed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = False

    async def gen(self):
        try:
            for i in range(self.n):
                yield b"data: %d\n\n" % i
            await asyncio.Event().wait()
        finally:
            self.closed = True


async def test_an_event_stream_is_written_whole_in_the_routes_task() -> None:
    from proxy.render import EventStream

    sent: list[dict] = []

    async def gen():
        yield b"data: a\n\n"
        yield b"data: [DONE]\n\n"

    async def send(message: dict) -> None:
        sent.append(message)

    ended = []
    await EventStream(gen(), {"x-pd-route": "local"}, on_end=lambda: ended.append(1))(
        {"type": "http"}, FakeRequest().receive, send)
    assert ended == [1]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"x-pd-route", b"local") in sent[0]["headers"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m.get("body") for m in sent[1:]] == [b"data: a\n\n", b"data: [DONE]\n\n", b""]
    assert [m.get("more_body") for m in sent[1:]] == [True, True, False]


@pytest.mark.parametrize("where", ["waiting_for_the_engine", "sending_a_chunk"])
async def test_a_hang_up_ends_an_event_stream_and_closes_its_chunks(where: str) -> None:
    """Whether the client leaves while the stream waits for the engine or while a chunk is
    being written, the response returns (no error: the client is gone) and the chunks'
    generator is closed at once (closing it closes the decode request: vLLM aborts it)."""
    from proxy.render import EventStream

    request = FakeRequest()
    chunks = Chunks(n=1)
    sending_blocks = asyncio.Event()

    async def send(message: dict) -> None:
        if where == "sending_a_chunk" and message.get("body"):
            sending_blocks.set()
            await asyncio.Event().wait()  # a client that stopped reading

    ended = []
    task = asyncio.create_task(EventStream(chunks.gen(), {}, lambda: ended.append(1))(
        {"type": "http"}, request.receive, send))
    if where == "sending_a_chunk":
        await asyncio.wait_for(sending_blocks.wait(), 5)
    else:
        await asyncio.sleep(0.05)
    assert not chunks.closed
    request.hang_up()
    await asyncio.wait_for(task, 5)
    assert chunks.closed and ended == [1]


async def test_an_event_stream_cancelled_for_another_reason_stays_cancelled() -> None:
    from proxy.render import EventStream

    chunks = Chunks(n=0)

    async def send(message: dict) -> None:
        pass

    task = asyncio.create_task(EventStream(chunks.gen(), {})({"type": "http"},
                                                             FakeRequest().receive, send))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert chunks.closed


async def test_an_event_stream_sends_a_failure_as_its_in_band_error_event() -> None:
    from proxy.errors import DecodeLost
    from proxy.render import EventStream

    async def gen():
        yield b"data: a\n\n"
        yield DecodeLost("the decode engine failed mid-stream", engine="decode-0")

    bodies: list[bytes] = []

    async def send(message: dict) -> None:
        bodies.append(message.get("body", b""))

    await EventStream(gen(), {})({"type": "http"}, FakeRequest().receive, send)
    error = json.loads(bodies[2].split(b"data: ")[1].split(b"\n\n")[0])
    assert error["error"]["type"] == "upstream_error" and bodies[-1] == b""
    assert b"data: [DONE]" in bodies[2]


async def test_a_request_s_hang_up_watch_leaves_no_reference_cycle_behind() -> None:
    """The watcher, cancelled at the end, keeps its CancelledError, whose frame holds the
    context manager: had the manager kept the watcher, every request would leave a cycle (two
    here, 17 objects each) for the garbage collector: 203 young-generation collections per
    3,000 requests of proxy_ab's load against 56 without the cycle (73 ms against 18 ms)."""
    async def served() -> None:
        request = FakeRequest()
        async with HangUpCancels(request.receive):
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the watcher takes its cancellation and ends

    await served()  # (first use: whatever is made once)
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            await served()
        assert gc.collect() == 0
    finally:
        gc.enable()
