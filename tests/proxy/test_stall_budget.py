"""Each request's stall budget: the gaps over its gap target it may still take with its p99 gap
within the target, kept on its ledger claim and counted from the gaps the proxy relays."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from harness.live_proxy import live_proxy, proxy_config, wait_until
from proxy.ledger import Ledger


@dataclass
class Named:
    name: str
    inflight: int = 0


def test_the_room_is_the_fewest_stalls_left_among_the_requests_decoding_there():
    ledger, d0, d1 = Ledger(), Named("d0"), Named("d1")
    assert ledger.stall_room("d0") == 0  # nobody there: nothing is spent (no streams either)
    a = ledger.claim(d0, output_tokens=256, itl_s=0.05)  # 255 gaps: 2 may stall
    b = ledger.claim(d0, output_tokens=1000, itl_s=0.05)  # 999 gaps: 9
    ledger.claim(d0, prompt_tokens=500)  # a prefill leg there streams nothing: not counted
    assert ledger.stall_room("d0") == 2
    a.stalled()
    assert (a.stall_room, ledger.stall_room("d0")) == (1, 1)
    a.stalled(), a.stalled()
    assert ledger.stall_room("d0") == 0  # spent (never below zero)
    a.release()
    assert ledger.stall_room("d0") == 9
    b.move_to(d1)  # a retry elsewhere: its budget goes with it
    assert (ledger.stall_room("d0"), ledger.stall_room("d1")) == (0, 9)
    ledger.claim(d1, output_tokens=256)  # no gap target: its gaps tolerate nothing known
    assert ledger.stall_room("d1") == 0


def hold_streams_open(decode, after_frames: int) -> None:
    """Six-token answers, each held after ``after_frames`` frames until the gate is set."""
    decode.stream_tokens = tuple(f"t{i}" for i in range(6))
    decode.decode_gate, decode.decode_gate_after_frames = asyncio.Event(), after_frames


def engine_name(lp, engine) -> str:
    """The proxy's name for the fake ``engine``."""
    (name,) = [e.name for e in lp.state.pool.all()
               if e.client.base_url == engine.url.rstrip("/")]
    return name


async def test_the_gaps_relayed_over_the_target_spend_the_streams_budget(prefill, decode):
    """A stream whose gaps (30 ms) are over its 5 ms target spends its budget (2 of 255 gaps)
    as its tokens are relayed; a 10 s target spends nothing; a request that states no
    max_tokens has no budget."""
    decode.decode_frame_interval_s = 0.03
    hold_streams_open(decode, after_frames=5)
    async with live_proxy(proxy_config(prefill, decode)) as lp, httpx.AsyncClient() as c:
        ledger, name = lp.state.orchestrator.ledger, engine_name(lp, decode)
        # (No max_tokens: the answer's length, so its budget, is not known: no room.)
        for itl_ms, room, max_tokens in ((5, 0, 256), (10_000, 2, 256), (10_000, 0, None)):
            decode.decode_gate.clear()
            body = {"model": "m", "prompt": "hi", "max_tokens": max_tokens, "stream": True,
                    "slo": {"itl_ms": itl_ms}}
            if max_tokens is None:
                del body["max_tokens"]
            async with c.stream("POST", lp.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                got = 0
                while got < 5:  # five tokens relayed, the stream held open by the engine
                    got += '"text":"t' in await anext(lines)
                await wait_until(lambda: ledger.stall_room(name) == room,
                                 f"room {room} (is {ledger.stall_room(name)})")
                decode.decode_gate.set()
                async for _ in lines:
                    pass
        await wait_until(lambda: not ledger._claims[name], "claims released")


async def test_the_plan_gives_the_policy_the_decode_engines_room(monkeypatch):
    """What the policy is told: the ledger's room on the chosen decode engine, and none while
    other clients' requests run there (their gaps are not known)."""
    from test_routing import request, setup

    import proxy.plan

    seen = []
    real = proxy.plan.decide
    monkeypatch.setattr(proxy.plan, "decide", lambda mode, inputs: seen.append(inputs) or real(
        mode, inputs))
    from proxy.policy import Targets

    pool, _, orch = setup(decodes=("d0",))
    orch.ledger.claim(pool.get("d0"), output_tokens=256, itl_s=0.05)
    await orch.plan(request())
    assert seen[-1].stall_room == 0  # no gap target: nothing to spend, the claims not walked
    orch.targets = Targets(itl_s=0.05)
    await orch.plan(request())
    assert seen[-1].stall_room == 2
    pool.get("d0")._foreign = 1  # as its metrics would say
    await orch.plan(request())
    assert seen[-1].stall_room == 0



def test_the_estimate_header_shows_the_room():
    from test_slo_policy import AUTO, costs

    from proxy.plan import Plan, estimate_header
    from proxy.policy import RouteInputs, Targets, decide

    d = decide(AUTO, RouteInputs(1000, costs=costs(), streams=4, targets=Targets(itl_s=0.05),
                                 stall_room=3))
    header = estimate_header(Plan(d, None, Named("d0"), 4000, 1000, 0, 16))
    assert header is not None and header.endswith("; stall_room=3"), header


def test_a_route_holds_the_stalls_it_will_spend_until_its_first_byte():
    ledger, d0 = Ledger(), Named("d0")
    a = ledger.claim(d0, output_tokens=256, itl_s=0.05)  # room 2
    b = ledger.claim(d0, output_tokens=1000, itl_s=0.05)  # room 9
    arrival = ledger.claim(d0, output_tokens=256, itl_s=0.05)
    arrival.hold_stalls(1)
    assert (a.stall_room, b.stall_room, arrival.stall_room) == (1, 8, 2)
    assert ledger.stall_room("d0") == 1  # a second arrival cannot spend a's last stall too
    arrival.drop_hold()
    assert (a.stall_room, b.stall_room) == (2, 9)
    arrival.hold_stalls(2)
    arrival.release()  # a request that ends before its first byte drops its hold too
    assert (a.stall_room, b.stall_room) == (2, 9)


async def test_the_orchestrator_holds_a_budgeted_routes_stalls_until_its_first_byte(
        prefill, decode, monkeypatch):
    """A stream decoding (held open), then an arrival whose route spends a stall
    (``slo_stall_budget``): while it is in its prefill the stream's room is one less, and once
    its first byte is out it is whole again."""
    from dataclasses import replace

    import proxy.plan

    real = proxy.plan.decide
    monkeypatch.setattr(proxy.plan, "decide", lambda mode, inputs: replace(
        real(mode, inputs), reason="slo_stall_budget", stalls=1))
    hold_streams_open(decode, after_frames=3)
    async with live_proxy(proxy_config(prefill, decode)) as lp, httpx.AsyncClient() as c:
        ledger, name = lp.state.orchestrator.ledger, engine_name(lp, decode)
        body = {"model": "m", "prompt": "hi", "max_tokens": 256, "stream": True,
                "slo": {"itl_ms": 10_000}}
        async with c.stream("POST", lp.url + "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            while '"text":"t0' not in await anext(lines):
                pass
            assert ledger.stall_room(name) == 2
            prefill.prefill_gate = asyncio.Event()
            second = asyncio.create_task(c.post(lp.url + "/v1/completions",
                                                json=dict(body, stream=False)))
            await wait_until(lambda: prefill.prefill_requests[-1:] and len(
                prefill.prefill_requests) == 2, "the second request in its prefill")
            assert ledger.stall_room(name) == 1
            prefill.prefill_gate.set()
            assert (await second).status_code == 200
            assert ledger.stall_room(name) == 2  # its hold dropped with it
            decode.decode_gate.set()
            async for _ in lines:
                pass
        await wait_until(lambda: not ledger._claims[name], "claims released")


def test_requests_prefilled_elsewhere_are_exposed_by_when_they_start_decoding():
    ledger, d0 = Ledger(), Named("d0")
    now = 100.0
    streaming = ledger.claim(d0, output_tokens=256, itl_s=0.05)  # room 2
    bound = ledger.claim(d0, output_tokens=16, itl_s=0.05)  # 15 gaps: room 0
    bound.expect_start(now + 4.0)  # its prompt is prefilled on another engine
    room, arriving = ledger.exposure("d0", now)
    assert room == 2 and [(a.in_s, a.room) for a in arriving] == [(4.0, 0)]
    assert ledger.exposure("d0", now + 5.0) == (0, ())  # overdue: counted as decoding
    # A route whose steps end in 1 s holds no stall from it; one ending after it starts does.
    arrival = ledger.claim(d0, output_tokens=64, itl_s=0.05)
    arrival.hold_stalls(1, until=now + 1.0)
    assert (streaming.held, bound.held) == (1, 0)
    arrival.drop_hold()
    arrival.hold_stalls(1, until=now + 4.5)
    assert (streaming.held, bound.held) == (1, 1)
    arrival.drop_hold()
    bound.expect_start(None)  # its KV is on its way
    assert ledger.exposure("d0", now) == (0, ())


async def test_a_request_is_an_arrival_on_its_decode_engine_until_its_prefill_is_done(
        prefill, decode):
    """While its prompt is prefilled on the prefill engine, a disaggregated request's decode
    claim says when it is due to start decoding (what a local prefill there may end before);
    once the prefill engine has answered, it counts as decoding there."""
    import time

    prefill.prefill_gate = gate = asyncio.Event()
    hold_streams_open(decode, after_frames=2)
    async with live_proxy(proxy_config(prefill, decode)) as lp, httpx.AsyncClient() as c:
        ledger, name = lp.state.orchestrator.ledger, engine_name(lp, decode)
        body = {"model": "m", "prompt": "hi", "max_tokens": 256, "stream": True,
                "slo": {"itl_ms": 10_000}}
        first = asyncio.Event()

        async def stream() -> None:
            async with c.stream("POST", lp.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if '"text":"t' in line:
                        first.set()

        streamed = asyncio.ensure_future(stream())
        await wait_until(lambda: ledger.exposure(name, time.monotonic())[1], "an arrival")
        room, (arrival,) = ledger.exposure(name, time.monotonic())
        assert room == 0 and 0 < arrival.in_s < 60  # its predicted TTFT, from now
        assert arrival.room == 2  # 255 gaps
        gate.set()
        await asyncio.wait_for(first.wait(), 30)
        assert ledger.exposure(name, time.monotonic()) == (2, ())  # decoding there
        decode.decode_gate.set()
        await asyncio.wait_for(streamed, 30)
        await wait_until(lambda: not ledger._claims[name], "claims released")
