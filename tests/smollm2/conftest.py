"""The default model's `pdserve dev` stack (SmolLM2-135M-Instruct, converted locally), shared by
this package's tests: a package of its own so that it runs alone, not beside tests/e2e/'s tiny
stack (four engines on two cores made the tiny stack's start 62 s, not 40, and every test on
either stack slower)."""

from __future__ import annotations

import pytest

from harness.stack import Stack, serving, start_dev
from launch import testbed
from tests.marks import mark_e2e


@pytest.fixture(scope="package")
def smollm2_stack(tmp_path_factory) -> Stack:
    """`pdserve dev` on the default model (SmolLM2-135M-Instruct), policy auto, with the prefill
    engine behind the throttled-link testbed when this machine can make one (root). KV for
    8,192 tokens per engine (64 blocks, 0.37 GB), two of the longest request here: vLLM set up
    1 GiB of it in ~10 s of each start; the prefill queue test's 8 x 2,000-token flood then
    queues on it, as it is meant to."""
    link = ["--link-mbit", "0"] if testbed.available() else []
    with serving(
        start_dev, model="smollm2", port=17000, engine_base_port=17100,
        side_channel_base_port=17600,
        log_dir=tmp_path_factory.mktemp("smollm2-stack"), model_name="SmolLM2-135M-Instruct",
        extra=["--kv-events-base-port", "17700", "--kv-blocks", "64", "--probe-tokens",
               "64,256", "--reprobe-s", "5", "--engine-dev-endpoints", *link],
    ) as stack:
        stack.prefill_url = stack.run_info()["engines"][0]["url"]
        yield stack


def pytest_collection_modifyitems(items):
    mark_e2e(items, "smollm2")
