"""An engine core hung behind a live API server (``proxy/stalls.py``): its /health answers, its
requests stall. Two stalls in a row with nothing generated between, and its probes ask it for
one generated token instead: none in time marks it down, and it is up again once it generates.
A busy engine that answers the token probe stays up.

The real counterpart: ``tests/layouts/test_migration_e2e.py`` (``core_frozen``: a vLLM engine
core SIGSTOPped, its API server alive).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from harness.fake_engine import FakeEngine
from harness.live_proxy import proxy_config, wait_until
from proxy.app import create_app
from proxy.engine import Engine
from proxy.stalls import STALLS_TO_MARK_DOWN, restart_due, stalled
from tests.proxy.test_migration import events, text_of
from tests.proxy.test_proxy_app import COMPLETIONS_PATH, SHORT_S, completions_body, metric, proxy

TOKENS = ("The", " quick", " brown", " fox", ".")


def test_stalls_in_a_row_make_an_engine_silent_once_and_output_starts_the_count_again():
    engine = Engine("decode", None)  # type: ignore[arg-type]
    assert [stalled(engine) for _ in range(STALLS_TO_MARK_DOWN - 1)] == [False] * (
        STALLS_TO_MARK_DOWN - 1)
    engine.stalls = 0  # what a relayed chunk does
    assert not stalled(engine) and not engine.silent
    assert stalled(engine) is (STALLS_TO_MARK_DOWN == 2) and engine.silent
    assert not stalled(engine)  # once


async def healthy(client: httpx.AsyncClient, name: str) -> bool:
    return (await client.get("/pd/costs")).json()["engines"][name]["healthy"]


def real_requests(engine: FakeEngine) -> int:
    """The engine's requests but the silent-engine probes' ("ping", one token)."""
    return sum(r.body.get("prompt") != "ping" for r in engine.decode_requests)


async def stall_on(client: httpx.AsyncClient, hung: FakeEngine) -> None:
    """Stream until ``hung`` has had its two requests (ties rotate: it gets its share); each
    stream completes, the stalled ones continued on the other engine."""
    for _ in range(4 * STALLS_TO_MARK_DOWN):
        resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
        assert resp.status_code == 200 and text_of(events(resp.content)) == "".join(TOKENS)
        if real_requests(hung) == STALLS_TO_MARK_DOWN:
            break
    assert real_requests(hung) == STALLS_TO_MARK_DOWN


@pytest.fixture(autouse=True)
def quick_token_probes(monkeypatch):
    monkeypatch.setattr("proxy.stalls.PROBE_TIMEOUT_S", 0.5)


async def test_an_engine_whose_core_hangs_behind_a_live_health_check_is_routed_around(
        decode: FakeEngine, decode2: FakeEngine):
    """decode-0's core hangs: its /health answers, its streams send headers and then nothing.
    Its first two streams stall past the idle deadline (each continues on decode-1); then its
    probe asks for a token, none comes, and it is marked down though its /health answers: the
    requests after go to decode-1 with no stall. Once its core runs again it generates the
    probe's token and is back up. Without the mark-down every other request would keep
    stalling there (checked: this test fails)."""
    for e in (decode, decode2):
        e.stream_tokens = TOKENS
    decode.core_hung = asyncio.Event()
    async with proxy(None, decode, decode_urls=(decode.url, decode2.url),
                     idle_deadline_s=SHORT_S, health_interval_s=0.05) as client:
        assert await healthy(client, "decode-0")
        await stall_on(client, decode)
        stalls = await metric(client, "pd_migrations_total", reason="decode_timeout")
        assert stalls == STALLS_TO_MARK_DOWN
        await wait_until(lambda: len(decode.decode_requests) > STALLS_TO_MARK_DOWN,
                         "a silent engine probed for a token")
        pool = client._transport.app.state.pd.pool  # type: ignore[attr-defined]
        await wait_until(lambda: not pool.get("decode-0").healthy, "marked down, no token")
        shown = (await client.get("/pd/costs")).json()["engines"]["decode-0"]
        assert (shown["healthy"], shown["silent"], shown["stalls"]) == (
            False, True, STALLS_TO_MARK_DOWN)  # what an operator sees, and why
        checks = decode.health_checks
        for _ in range(4):
            resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
            assert resp.status_code == 200
        assert real_requests(decode) == STALLS_TO_MARK_DOWN
        assert await metric(client, "pd_migrations_total", reason="decode_timeout") == stalls
        assert decode.health_checks == checks  # (its /health, which answers, is not asked)
        decode.core_hung.set()
        await wait_until(lambda: decode.health_checks > checks, "probed by /health again")
        assert await healthy(client, "decode-0")


async def test_a_suspect_engine_gets_no_new_request_while_its_token_probe_waits(
        decode: FakeEngine, decode2: FakeEngine, monkeypatch):
    """Between decode-0's second stall and its token probe's answer (here a probe that waits
    30 s) it is still up, and suspect: the new requests go to decode-1, none stalls. Ties
    rotating would have sent every other one there, to wait out the idle deadline (checked:
    this test fails with the suspect engine picked as any other)."""
    monkeypatch.setattr("proxy.stalls.PROBE_TIMEOUT_S", 30.0)
    for e in (decode, decode2):
        e.stream_tokens = TOKENS
    decode.core_hung = asyncio.Event()
    async with proxy(None, decode, decode_urls=(decode.url, decode2.url),
                     idle_deadline_s=SHORT_S, health_interval_s=0.05) as client:
        await stall_on(client, decode)
        pool = client._transport.app.state.pd.pool  # type: ignore[attr-defined]
        assert pool.get("decode-0").silent and pool.get("decode-0").healthy
        stalls = await metric(client, "pd_migrations_total", reason="decode_timeout")
        for _ in range(4):
            resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
            assert resp.status_code == 200 and text_of(events(resp.content)) == "".join(TOKENS)
        assert real_requests(decode) == STALLS_TO_MARK_DOWN
        assert await metric(client, "pd_migrations_total", reason="decode_timeout") == stalls
        assert pool.get("decode-0").healthy  # (its probe still waiting: not down yet)
        decode.core_hung.set()


async def test_a_busy_engine_whose_requests_ran_out_of_time_but_that_generates_stays_up(
        decode: FakeEngine, decode2: FakeEngine):
    """Two streams on decode-0 wait past the headers deadline (504 each), nothing generated;
    but the engine answers the token probe that follows: not hung, never marked down, and its
    /health asked again after."""
    decode.decode_gate, decode.decode_gate_after_frames = asyncio.Event(), 0

    async def free_after_two() -> None:  # (the requests already there keep waiting)
        while real_requests(decode) < STALLS_TO_MARK_DOWN:
            await asyncio.sleep(0.005)
        decode.decode_gate = None

    async with proxy(None, decode, decode_urls=(decode.url, decode2.url),
                     headers_deadline_s=SHORT_S, health_interval_s=0.05) as client:
        pool = client._transport.app.state.pd.pool  # type: ignore[attr-defined]
        freeing = asyncio.create_task(free_after_two())
        statuses = []
        for _ in range(4 * STALLS_TO_MARK_DOWN):
            resp = await client.post(COMPLETIONS_PATH, json=completions_body(stream=True))
            statuses.append(resp.status_code)
            if statuses.count(504) == STALLS_TO_MARK_DOWN:
                break
        await freeing
        assert statuses.count(504) == STALLS_TO_MARK_DOWN, statuses
        await wait_until(lambda: len(decode.decode_requests) > STALLS_TO_MARK_DOWN,
                         "probed for a token")
        await wait_until(lambda: not pool.get("decode-0").silent, "its token answered")
        checks = decode.health_checks
        await wait_until(lambda: decode.health_checks > checks, "probed by /health again")
        assert pool.get("decode-0").healthy and pool.get("decode-0").stalls == 0


def test_a_restart_is_due_once_the_engine_has_been_down_for_its_hung_core_long_enough():
    engine = Engine("decode", None)  # type: ignore[arg-type]
    engine.silent, engine.silent_down_at = True, 100.0
    assert [restart_due(engine, now, 60.0) for now in (159.9, 160.0)] == [False, True]
    engine.healthy = True  # (up again: its token came)
    assert not restart_due(engine, 500.0, 60.0)
    engine.healthy, engine.silent_down_at = False, None  # down for another cause, or asked
    assert not restart_due(engine, 500.0, 60.0)


class Restarts:
    """A launcher's restarter: records what it was asked to restart."""

    def __init__(self):
        self.asked: list[tuple[str, str]] = []

    async def restart(self, name: str, url: str) -> None:
        self.asked.append((name, url))


async def test_an_engine_down_for_its_hung_core_is_restarted_once_after_the_hang_timeout(
        decode: FakeEngine, decode2: FakeEngine):
    """decode-0's core hangs: two stalls, no token, down; 0.5 s later (``hung_restart_s``)
    its launcher is asked to restart it, once; decode-1, busy with nothing, never."""
    for e in (decode, decode2):
        e.stream_tokens = TOKENS
    decode.core_hung = asyncio.Event()
    restarts = Restarts()
    config = proxy_config(None, decode, decode_urls=(decode.url, decode2.url),
                          idle_deadline_s=SHORT_S, health_interval_s=0.05, hung_restart_s=0.5)
    app = create_app(config, restarter=restarts)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        pool = app.state.pd.pool
        await stall_on(client, decode)
        await wait_until(lambda: not pool.get("decode-0").healthy, "marked down, no token")
        assert restarts.asked == []  # (not before its time)
        await wait_until(lambda: restarts.asked != [], "asked to restart it")
        await asyncio.sleep(2.5)  # more rounds of the restart loop (1 s apart): asked once
        assert restarts.asked == [("decode-0", decode.url)]
