"""``serve_unless_disconnected``: the work runs in the caller's task; a hang-up cancels it and
becomes ClientGone; any other cancellation (server shutdown) stays a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from proxy.client_io import ClientGone, serve_unless_disconnected


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
