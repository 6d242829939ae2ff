"""Warm-ups and probes (``proxy/warmup.py``) go only where new work may go: engines up, neither
draining nor cordoned. A warm-up or probe sent through an engine that is down waits out its
deadline (2 x 120 s a pair for a hung one) while the proxy reports not ready; one sent to an
engine being drained or cordoned is work it was promised not to get.

No engines here: pools of fake clients, and ``_warm_pair`` / ``Orchestrator.serve`` replaced by
recorders.
"""

from __future__ import annotations

import asyncio

import pytest

from proxy import warmup
from proxy.metrics import ProxyMetrics
from proxy.pool import EnginePool


class Client:
    """An engine client nothing is sent to (the warm-up's requests are recorded instead)."""

    base_url = "http://127.0.0.1:1"

    def __init__(self, name: str):
        self.name = name


def pool_of(prefill: int, decode: int) -> EnginePool:
    """All engines up."""
    pool = EnginePool([Client(f"prefill-{i}") for i in range(prefill)],
                      [Client(f"decode-{i}") for i in range(decode)], ProxyMetrics())
    for e in pool.all():
        e.healthy = True
    return pool


def shut(pool: EnginePool, how: str) -> None:
    """Take prefill-1 out of new work: down, draining or cordoned."""
    engine = pool.get("prefill-1")
    assert engine is not None
    if how == "down":
        engine.healthy = False
    elif how == "draining":
        engine.draining = True
    else:
        pool.assign(prefill=["prefill-0"], decode=[e.name for e in pool.decode])


@pytest.fixture
def warmed(monkeypatch) -> list[tuple[str, str]]:
    """The (prefill, decode) pairs ``_warm_pair`` is called for (each succeeds)."""
    calls: list[tuple[str, str]] = []

    async def warm_pair(prefill, decode, model):
        calls.append((prefill.name, decode.name))
        return True

    monkeypatch.setattr(warmup, "_warm_pair", warm_pair)
    return calls


class Orchestrator:
    """Records the engines each probe is sent through."""

    prompts = None

    def __init__(self, pool: EnginePool):
        self.pool = pool
        self.served: list[tuple[str | None, str | None]] = []

    async def serve(self, req, prefill=None, decode=None):
        self.served.append((prefill and prefill.name, decode and decode.name))
        raise RuntimeError("not served here")  # a failed probe: logged, skipped


@pytest.mark.parametrize("how", ["down", "draining", "cordoned"])
async def test_start_up_warm_up_pays_no_handshake_with_an_engine_shut_to_new_work(how, warmed):
    pool = pool_of(2, 1)
    shut(pool, how)
    assert await warmup.warm_up_pairs(pool, "m")
    assert warmed == [("prefill-0", "decode-0")]


@pytest.mark.parametrize("how", ["down", "draining", "cordoned"])
async def test_start_up_probes_go_through_no_engine_shut_to_new_work(how):
    pool = pool_of(2, 1)
    shut(pool, how)
    orch = Orchestrator(pool)
    await warmup.probe_routes(orch, "m", (8, 16))
    assert orch.served and all(p != "prefill-1" for p, _ in orch.served), orch.served


async def test_start_up_local_probes_skip_a_decode_engine_that_is_down():
    pool = pool_of(0, 2)
    pool.decode[1].healthy = False
    orch = Orchestrator(pool)
    await warmup.probe_routes(orch, "m", (8,))
    assert orch.served == [(None, "decode-0")] * 2


async def test_the_start_up_warm_up_gives_up_at_its_deadline(monkeypatch):
    """A handshake that hangs (an engine not yet seen down) holds the proxy not ready only up
    to the warm-up's deadline."""
    started = asyncio.Event()

    async def hung_pair(prefill, decode, model):
        started.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(warmup, "_warm_pair", hung_pair)
    pool = pool_of(1, 1)
    assert not await warmup.warm_up_at_start(Orchestrator(pool), "m", (8,), timeout_s=0.2)
    assert started.is_set()


def service_of(pool: EnginePool):
    import zmq.asyncio

    from proxy.config import ProxyConfig
    from proxy.engine_client import new_session
    from proxy.service import ProxyService

    config = ProxyConfig(decode_urls=("http://127.0.0.1:1",), served_model_names=("m",),
                         policy="local", reprobe_s=0)
    return ProxyService(config, None, None, new_session(), pool, None, pool._metrics,
                        zmq.asyncio.Context())


async def test_an_engine_up_only_once_the_start_up_warm_up_began_is_warmed_too(
        monkeypatch, warmed):
    """The start-up warm-up looks at the pairs open when it begins; decode-1, up only later
    (its engine still loading, say), is warmed on its own as it comes up, not by its users'
    first requests."""
    import proxy.service

    pool = pool_of(1, 2)
    late = pool.get("decode-1")
    late.healthy = False
    at_start, release = asyncio.Event(), asyncio.Event()

    async def start_up_warm_up(orchestrator, model, probe_tokens):
        at_start.set()
        await release.wait()
        return True

    monkeypatch.setattr(proxy.service, "warm_up_at_start", start_up_warm_up)
    service = service_of(pool)
    task = asyncio.create_task(service._warm_up())
    await at_start.wait()
    pool.set_health(late, True)  # its first probe answers
    release.set()
    await task
    await asyncio.gather(*service._tasks)  # the warm-up of decode-1
    assert warmed == [("prefill-0", "decode-1")] and not late.warming
    await service.stop()


class Costs:
    def link_samples(self, prefill: str, decode: str) -> int:
        return 0  # no hand-over seen on any pair: every open pair is reprobed


@pytest.mark.parametrize("how", ["down", "draining", "cordoned"])
async def test_link_reprobes_go_through_no_engine_shut_to_new_work(how):
    """A draining engine sees no hand-over: it was the surest pair to be reprobed."""
    pool = pool_of(2, 1)
    shut(pool, how)
    orch = Orchestrator(pool)
    orch.costs = Costs()  # type: ignore[attr-defined]
    probed = asyncio.Event()
    serve = orch.serve

    async def count(req, prefill=None, decode=None):
        if len(orch.served) == 3:  # prefill-0's pair reprobed thrice: rounds went by
            probed.set()
        return await serve(req, prefill, decode)

    orch.serve = count  # type: ignore[method-assign]
    task = asyncio.create_task(warmup.reprobe_links(orch, "m", (8,), 0.001))
    await asyncio.wait_for(probed.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert {p for p, _ in orch.served} == {"prefill-0"}


@pytest.mark.parametrize("how", ["draining", "cordoned"])
async def test_an_engine_draining_or_cordoned_that_comes_back_up_is_sent_no_warm_up(
        how, warmed):
    """Its relays see a drain's cut, a failed request marks it down, the next probe brings it
    up: no handshake requests to an engine being removed or cordoned."""
    pool = pool_of(2, 1)
    shut(pool, how)
    assert await warmup.warm_up_engine(pool, pool.get("prefill-1"), "m")
    assert warmed == []


@pytest.mark.parametrize("how", ["down", "draining", "cordoned"])
async def test_an_engine_that_comes_up_pays_no_handshake_with_an_engine_shut_to_new_work(
        how, warmed):
    pool = pool_of(2, 1)
    shut(pool, how)
    assert await warmup.warm_up_engine(pool, pool.get("decode-0"), "m")
    assert warmed == [("prefill-0", "decode-0")]


@pytest.fixture
def handshaking(monkeypatch) -> tuple[asyncio.Queue, list[asyncio.Event]]:
    """``_warm_pair`` held until its gate is set: (each call's gate, as it starts; the gates of
    the calls under way)."""
    started: asyncio.Queue[asyncio.Event] = asyncio.Queue()
    running: list[asyncio.Event] = []

    async def warm_pair(prefill, decode, model):
        gate = asyncio.Event()
        running.append(gate)
        started.put_nowait(gate)
        try:
            await gate.wait()
        finally:
            running.remove(gate)
        return True

    monkeypatch.setattr(warmup, "_warm_pair", warm_pair)
    return started, running


async def test_a_flapping_engine_is_warmed_once_at_a_time_and_warming_until_the_last_ends(
        handshaking):
    """Each up spawned its own warm-up: an engine that flapped had several at once, and the
    first to end marked it warm while a later one still paid the handshakes."""
    started, running = handshaking
    pool = pool_of(1, 1)
    decode = pool.get("decode-0")
    decode.healthy = False
    warm_ups: list[asyncio.Task] = []
    pool.on_up = lambda e: warm_ups.append(
        asyncio.create_task(warmup.warm_up_engine(pool, e, "m")))
    pool.set_health(decode, True)
    await started.get()
    pool.mark_down(decode)  # it flapped: down (a failed request), up (the next probe)
    pool.set_health(decode, True)
    last = await started.get()
    assert len(running) == 1 and warm_ups[0].done()
    assert await warm_ups[0] is False  # replaced: ended, quietly
    assert decode.warming
    last.set()
    assert await warm_ups[1] is True
    assert not decode.warming and decode.warm_up is None


async def test_a_warm_up_cancelled_by_the_proxy_stopping_is_cancelled(handshaking):
    started, _ = handshaking
    pool = pool_of(1, 1)
    task = asyncio.create_task(warmup.warm_up_engine(pool, pool.get("decode-0"), "m"))
    await started.get()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not pool.get("decode-0").warming
