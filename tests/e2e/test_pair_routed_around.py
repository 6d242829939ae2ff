"""A prefill engine whose KV the decode engine cannot pull is routed around, for real.

A third tiny-model engine is started from the same weights under another path. vLLM's NIXL
compatibility hash covers the model path, so every handshake between it and the tiny stack's
decode engine fails ("NIXL compatibility hash mismatch", as seen on two nodes whose model paths
differed), and each request sent through that pair is served by the decode engine computing
the prompt itself. A proxy in front of both prefill engines and the decode engine must find the
pair from the decode engine's own count of failed pulls, and send the rest through the good one
(``proxy/pair_health.py``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from harness.live_proxy import live_proxy
from harness.prompts import text_of_tokens
from launch.dev import DevOptions, engine_specs
from launch.models import ensure_model
from launch.processes import EngineProcess, check_ports_free, start_engine, stop_engines, wait_ready
from launch.settings import EngineSettings
from proxy.config import ProxyConfig
from transport.engine_metrics import engine_load

ODD_PORT, ODD_SIDE_CHANNEL, ODD_KV_EVENTS = 18190, 15690, 15790
ODD, GOOD, DECODE = "prefill-0", "prefill-1", "decode-0"  # the proxy's names, by url order
HANDOVERS = "pd_handover_seconds_count"


@pytest.fixture
def odd_prefill(tiny_stack, tmp_path) -> Iterator[str]:
    """A prefill engine on the tiny model's weights under another path; its url."""
    elsewhere = tmp_path / "tiny-elsewhere"
    elsewhere.symlink_to(Path(ensure_model("tiny")).resolve(), target_is_directory=True)
    opts = DevOptions(
        model_path=str(elsewhere), served_model_name=tiny_stack.model_name,
        engine_base_port=ODD_PORT, side_channel_base_port=ODD_SIDE_CHANNEL,
        kv_events_base_port=ODD_KV_EVENTS, log_dir=tmp_path,
        engines=EngineSettings(kv_blocks=512))
    spec, _ = engine_specs(opts, api_key=tiny_stack.engine_key)
    check_ports_free([("odd prefill engine", spec.port),
                      ("its side channel", spec.side_channel_port),
                      ("its KV events", ODD_KV_EVENTS)])
    engines: list[EngineProcess] = [start_engine(spec, tmp_path)]
    try:
        wait_ready(engines, 300.0)
        yield f"http://127.0.0.1:{spec.port}"
    finally:
        stop_engines(engines)


def failed_pulls(url: str) -> float:
    return engine_load(httpx.get(url + "/metrics", timeout=10).text).nixl_failed


async def test_a_pair_whose_kv_pulls_fail_is_routed_around(tiny_stack, odd_prefill):
    config = ProxyConfig(
        prefill_urls=(odd_prefill, tiny_stack.prefill_url), decode_urls=(tiny_stack.decode_url,),
        served_model_names=(tiny_stack.model_name,), engine_key=tiny_stack.engine_key,
        policy="disaggregate", warmup=False, probe_tokens=(), reprobe_s=0,
        health_interval_s=0.5)
    failed_before = failed_pulls(tiny_stack.decode_url)
    async with live_proxy(config) as lp:
        client = openai.AsyncOpenAI(base_url=lp.url + "/v1", api_key="unused", max_retries=0)
        health = lp.state.pool.pair_health
        seed = iter(range(7000, 8000))

        async def answer() -> str:
            stream = await client.completions.create(
                model=tiny_stack.model_name, prompt=text_of_tokens(300, seed=next(seed)),
                max_tokens=4, temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        # Round robin sends every other request through the odd pair until it is found.
        deadline = time.monotonic() + 60
        while not health.routed_around(time.monotonic()):
            assert time.monotonic() < deadline, "the failing pair was not found within 60 s"
            assert await answer()  # served all the same: the decode engine computed the prompt
        routed = health.routed_around(time.monotonic())
        assert [(r["prefill"], r["decode"]) for r in routed] == [(ODD, DECODE)]
        # The failures were real: the decode engine's NIXL counted them.
        assert failed_pulls(tiny_stack.decode_url) > failed_before
        odd_tried = lp.metric(HANDOVERS, prefill=ODD, decode=DECODE)
        good_before = lp.metric(HANDOVERS, prefill=GOOD, decode=DECODE)
        assert odd_tried >= 1
        print(f"the odd pair found after {odd_tried:.0f} hand-overs through it")

        # Found, the pair gets nothing: every request is a hand-over through the good pair, and
        # the decode engine fails no more pulls.
        failed_found = failed_pulls(tiny_stack.decode_url)
        for _ in range(6):
            assert await answer()
        assert lp.metric(HANDOVERS, prefill=GOOD, decode=DECODE) == good_before + 6
        assert lp.metric(HANDOVERS, prefill=ODD, decode=DECODE) == odd_tried
        assert failed_pulls(tiny_stack.decode_url) == failed_found
        async with httpx.AsyncClient() as http:  # (the proxy runs on this loop)
            view = (await http.get(lp.url + "/pd/costs", timeout=10)).json()
        view = view["pairs_routed_around"]
        assert [(r["prefill"], r["decode"]) for r in view] == [(ODD, DECODE)]
