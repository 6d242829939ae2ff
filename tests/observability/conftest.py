"""A tiny-model `pdserve dev --observability` stack: the Prometheus it starts (Debian's
``prometheus`` package; `.ci/run` installs it) scrapes the proxy and both engines every second,
and all three send their traces to an OTLP receiver in this process.
Policy auto with latency targets (the ITL prediction has something to predict) and a small
offload tier, so every panel of the dashboard has series to show."""

from __future__ import annotations

import os

import pytest

from harness.otlp_receiver import OtlpReceiver
from harness.stack import Stack, serving, start_dev
from launch.observability.prometheus import binary
from tests.marks import mark_e2e

PROMETHEUS_PORT = 19090


@pytest.fixture(scope="package")
def otlp() -> OtlpReceiver:
    """Where the proxy and both engines send their traces (OTLP over HTTP)."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="package")
def obs_stack(tmp_path_factory, otlp) -> Stack:
    if binary() is None:
        message = "no prometheus binary (apt-get install prometheus)"
        if os.environ.get("CI"):
            pytest.fail(message + ": CI must have it (.ci/run installs it)")
        pytest.skip(message)
    with serving(
        start_dev, model="tiny", port=14000, engine_base_port=14100,
        side_channel_base_port=14600, kv_events_base_port=14700,
        log_dir=tmp_path_factory.mktemp("obs-stack"), model_name="pdserve-tiny",
        extra=["--observability", "--prometheus-port", str(PROMETHEUS_PORT),
               "--scrape-interval-s", "1", "--kv-blocks", "512", "--offload-gib", "0.25",
               "--slo-ttft-ms", "2000", "--slo-itl-ms", "500", "--probe-tokens", "64,256",
               "--reprobe-s", "0", "--otlp-traces-endpoint", otlp.endpoint],
        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
             "OTEL_BSP_SCHEDULE_DELAY": "200"},  # export every 0.2 s, not 5 s
    ) as stack:
        yield stack


def pytest_collection_modifyitems(items):
    mark_e2e(items, "observability")
