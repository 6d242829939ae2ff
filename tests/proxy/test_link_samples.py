"""The link fit learns from hand-overs that timed the link: not from one that waited on the
decode engine behind a prompt computed there (fake engines; the real wait: SmolLM2, a 64-token
hand-over behind a 1,024-token local prefill took 4.4-4.8 s against 0.34-0.37 s alone)."""

from __future__ import annotations

import asyncio

import httpx

from harness.live_proxy import live_proxy, proxy_config, wait_until
from tests.proxy.test_stall_budget import engine_name

SHORT = [7] * 20  # under the threshold: computed on the decode engine
LONG = list(range(100, 500))  # 400 tokens: prefilled on the prefill engine, its KV moved


def body(prompt: list[int]) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True}


async def test_a_hand_over_queued_behind_a_local_prefill_is_not_a_link_sample(prefill, decode):
    config = proxy_config(prefill, decode, policy="threshold:100")
    async with live_proxy(config) as lp, httpx.AsyncClient(timeout=30) as c:
        costs = lp.state.orchestrator.costs
        pair = (engine_name(lp, prefill), engine_name(lp, decode))
        before = costs.link_samples(*pair)

        decode.decode_gate = gate = asyncio.Event()  # the local prompt: computing, no token yet
        held = asyncio.create_task(c.post(lp.url + "/v1/completions", json=body(SHORT)))
        await wait_until(lambda: costs.queued_tokens(pair[1]) == len(SHORT), "local queued")
        # (The proxy queues it before sending: the gate is taken when the engine has it.)
        await wait_until(lambda: len(decode.decode_requests) == 1, "local at the engine")
        decode.decode_gate = None
        r = await c.post(lp.url + "/v1/completions", json=body(LONG))
        assert r.status_code == 200 and r.headers["x-pd-route"] == "disaggregated"
        assert costs.link_samples(*pair) == before  # it waited behind the local prompt

        gate.set()
        assert (await held).headers["x-pd-route"] == "local"
        r = await c.post(lp.url + "/v1/completions", json=body(LONG[::-1]))
        assert r.headers["x-pd-route"] == "disaggregated"
        assert costs.link_samples(*pair) == before + 1  # alone: it timed the link
