"""A `pdserve dev` stack with a host-memory offload tier and a deliberately small engine KV cache
(24 blocks of 128 tokens), so a few prompts evict each other from the engine into the tier; the
prefill's KV lease is short (6 s) so a hand-off's blocks can expire and be reused in a test."""

from __future__ import annotations

import signal

import pytest

from harness.stack import Stack, serving, start_dev
from tests.marks import mark_e2e

KV_BLOCKS = 24
LEASE_S = 6


@pytest.fixture(scope="package")
def tier_stack(tmp_path_factory) -> Stack:
    # Stopped with SIGHUP (the terminal closed): it must stop the engines like SIGTERM does.
    with serving(
        start_dev, model="tiny", stop_signal=signal.SIGHUP, port=16000, engine_base_port=16100, side_channel_base_port=16600,
        log_dir=tmp_path_factory.mktemp("tier-stack"), model_name="pdserve-tiny",
        extra=["--policy", "local", "--kv-events-base-port", "16700", "--offload-gib", "0.25",
               "--kv-blocks", str(KV_BLOCKS), "--max-model-len", "2048", "--probe-tokens", "",
               "--lease-s", str(LEASE_S)],
    ) as stack:
        yield stack


def pytest_collection_modifyitems(items):
    mark_e2e(items, "offload")
