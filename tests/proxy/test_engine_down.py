"""When the proxy takes an engine out, and what happens to requests waiting on it then.

A slow health probe alone does not take an engine out (a busy engine answers late), unless not
even a new TCP connection to it opens (a host cut off: nothing answers, nothing refuses). Marked
down, an engine releases every request waiting on it for a whole reply (a prefill): the prefill
leg falls back to the decode engine at once instead of waiting out its deadline, and its
streams are cut so that they continue on another decode engine (when one is up).
A probe never stops the probing: what it cannot foresee is a failed probe, a figure it cannot
read (NaN) is skipped; and each engine is probed at its own pace (a silent one holds back only
its own probes).
The real counterparts: ``tests/ray/test_placement.py``'s cut link and the stalled engine of
``tests/layouts/test_migration_e2e.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from proxy.engine import EngineLost
from proxy.engine_client import EngineTimeout
from proxy.metrics import ProxyMetrics
from proxy.pool import EnginePool
from proxy.probes import SLOW_PROBES_TO_MARK_DOWN


class SlowClient:
    """An engine whose probes time out; ``reachable``: whether a new connection opens."""

    base_url = "http://x"

    def __init__(self, reachable: bool, name: str = "prefill-0"):
        self.name = name
        self.reachable = reachable
        self.connect_checks = 0

    async def get_text(self, path, timeout_s):
        raise EngineTimeout("slow")

    async def connects(self, timeout_s):
        self.connect_checks += 1
        return self.reachable


def pool_of(client) -> EnginePool:
    pool = EnginePool([client], [], ProxyMetrics())
    pool.prefill[0].healthy = True
    return pool


async def test_slow_probes_of_an_engine_that_accepts_connections_take_it_out_only_in_a_row():
    pool = pool_of(SlowClient(reachable=True))
    (engine,) = pool.prefill
    for _ in range(SLOW_PROBES_TO_MARK_DOWN - 1):
        assert await pool.probe(engine) is True and engine.healthy
    assert await pool.probe(engine) is False and not engine.healthy


async def test_a_slow_probe_of_an_engine_no_connection_reaches_takes_it_out_at_once():
    client = SlowClient(reachable=False)
    pool = pool_of(client)
    (engine,) = pool.prefill
    assert await pool.probe(engine) is False and not engine.healthy
    assert client.connect_checks == 1


async def waiting_on(engine, entered: asyncio.Event) -> str:
    with engine.given_up_when_down():
        entered.set()
        await asyncio.sleep(60)
    return "answered"


async def test_marked_down_an_engine_releases_the_requests_waiting_on_it():
    pool = pool_of(SlowClient(reachable=False))
    (engine,) = pool.prefill
    entered = [asyncio.Event() for _ in range(2)]
    waiters = [asyncio.create_task(waiting_on(engine, e)) for e in entered]
    for e in entered:
        await e.wait()
    await pool.probe(engine)
    for w in waiters:
        with pytest.raises(EngineLost):
            await asyncio.wait_for(w, 5)
    assert not engine._waiting and not engine._given_up  # nothing kept


async def test_a_waiter_cancelled_for_its_own_reasons_is_cancelled_not_given_up():
    """The client hung up: the cancellation goes on up (the request is aborted), even when the
    engine is marked down in the same breath."""
    pool = pool_of(SlowClient(reachable=False))
    (engine,) = pool.prefill
    entered = asyncio.Event()
    waiter = asyncio.create_task(waiting_on(engine, entered))
    await entered.wait()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await pool.probe(engine)  # marked down after: nothing left to give up
    assert not engine._waiting and not engine._given_up


async def test_a_client_hang_up_in_the_same_breath_as_a_mark_down_is_a_hang_up():
    """Both cancel the waiting task before it runs again: one CancelledError arrives for two
    cancels. Taken for a mark-down alone, the request would be served again locally for a
    client that is gone."""
    pool = pool_of(SlowClient(reachable=False))
    (engine,) = pool.prefill
    entered = asyncio.Event()
    waiter = asyncio.create_task(waiting_on(engine, entered))
    await entered.wait()
    engine.give_up_waiting(replaced=True)  # the mark-down ...
    waiter.cancel()  # ... and the client's hang-up
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not engine._waiting and not engine._given_up


async def test_only_the_mark_down_releases_not_every_failed_probe_of_an_engine_already_down():
    """A request sent to an engine already down (picked when nothing better was up, say) is
    not cut by the probes that keep failing: only the transition up -> down releases."""
    pool = pool_of(SlowClient(reachable=False))
    (engine,) = pool.prefill
    await pool.probe(engine)
    assert not engine.healthy
    entered = asyncio.Event()
    waiter = asyncio.create_task(waiting_on(engine, entered))
    await entered.wait()
    await pool.probe(engine)  # fails again: still down, no transition
    await asyncio.sleep(0.05)
    assert not waiter.done()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


class Stream:
    closed = False

    def close(self):
        self.closed = True


async def test_marked_down_an_engine_cuts_its_streams_when_another_decode_engine_is_up():
    pool = EnginePool([], [SlowClient(False, "decode-0"), SlowClient(False, "decode-1")],
                      ProxyMetrics())
    for e in pool.decode:
        e.healthy = True
    stream = Stream()
    pool.decode[0].open_streams.add(stream)
    await pool.probe(pool.decode[0])
    assert stream.closed  # its relay sees the engine lost and continues it on decode-1


@pytest.mark.parametrize("other", ["none", "down", "draining"])
async def test_with_no_other_decode_engine_to_go_to_the_streams_stay(other):
    clients = [SlowClient(False, "decode-0")] + ([] if other == "none"
                                                 else [SlowClient(False, "decode-1")])
    pool = EnginePool([], clients, ProxyMetrics())
    pool.decode[0].healthy = True
    if other == "draining":
        pool.decode[1].healthy = pool.decode[1].draining = True
    stream = Stream()
    pool.decode[0].open_streams.add(stream)
    await pool.probe(pool.decode[0])
    assert not pool.decode[0].healthy and not stream.closed


class PageClient:
    """An engine that answers its health check and serves ``page`` as its metrics; ``error``:
    raised by every call instead (a bug of ours, say). ``probed`` is set at each call."""

    base_url = "http://x"

    def __init__(self, name: str, page: str = "", error: Exception | None = None):
        self.name = name
        self.page = page
        self.error = error
        self.probed = asyncio.Event()

    async def get_text(self, path, timeout_s):
        self.probed.set()
        if self.error is not None:
            raise self.error
        return 200, self.page if path == "/metrics" else ""


async def test_a_figure_read_as_nan_or_infinite_on_an_engines_metrics_is_skipped():
    """``int(NaN)`` raised out of the probe: the engine's load kept its last reading."""
    client = PageClient("decode-0", "vllm:num_requests_running 3\n"
                                    "vllm:nixl_num_failed_transfers_total 1\n")
    pool = EnginePool([], [client], ProxyMetrics())
    (engine,) = pool.decode
    assert await pool.probe(engine) and engine.engine_requests == 3
    client.page = ("vllm:num_requests_running NaN\nvllm:nixl_xfer_time_seconds_count +Inf\n"
                   "vllm:nixl_num_failed_transfers_total NaN\n")
    assert await pool.probe(engine) and engine.healthy
    assert engine.engine_requests == 3 and engine.kv_pull_failures == 0
    client.page = "vllm:num_requests_running 1\nvllm:nixl_num_failed_transfers_total 2\n"
    assert await pool.probe(engine)
    assert engine.engine_requests == 1 and engine.kv_pull_failures == 1


async def test_a_probe_failing_unforeseen_is_a_failed_probe_and_the_others_go_on():
    """An exception nobody foresaw out of one engine's probe used to end the health loop, for
    every engine, for good (silently: nothing marked up or down by probes again)."""
    odd = PageClient("decode-0", error=RuntimeError("a bug of ours"))
    other = PageClient("decode-1")
    pool = EnginePool([], [odd, other], ProxyMetrics())
    for e in pool.decode:
        e.healthy = True
    loop = asyncio.create_task(pool.run_health_loop(0.001))
    try:
        for _ in range(3):  # probed again and again: the loop lives on
            for client in (odd, other):
                client.probed.clear()
                await asyncio.wait_for(client.probed.wait(), 5)
        assert not pool.decode[0].healthy and pool.decode[1].healthy
    finally:
        loop.cancel()


class SilentClient:
    """An engine whose probes never answer (until cancelled): each waits on its own."""

    base_url = "http://x"

    def __init__(self, name: str):
        self.name = name
        self.probes = 0
        self.cancelled = asyncio.Event()

    async def get_text(self, path, timeout_s):
        self.probes += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_a_silent_engine_holds_back_only_its_own_probes():
    """Each round of probes waited for all of them, so one engine silent up to the health
    timeout (2 s) held every other engine's probes that long: a failure found that much later."""
    silent, other = SilentClient("decode-0"), PageClient("decode-1")
    pool = EnginePool([], [silent, other], ProxyMetrics())
    loop = asyncio.create_task(pool.run_health_loop(0.001))
    for _ in range(3):  # decode-1 probed again and again ...
        other.probed.clear()
        await asyncio.wait_for(other.probed.wait(), 5)
    assert silent.probes == 1  # ... while decode-0's one probe is still out
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop
    await asyncio.wait_for(silent.cancelled.wait(), 5)  # its probe ends with the loop
