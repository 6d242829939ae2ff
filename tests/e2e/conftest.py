"""Real-engine fixture: one tiny-model `pdserve dev` stack, shared by this package's tests and
stopped when they are done (before the next package starts its own engines: this box has memory,
and cores, for one set at a time). The SmolLM2 stack is tests/smollm2/'s."""

from __future__ import annotations

import pytest

from harness.stack import Stack, serving, start_dev
from tests.marks import mark_e2e

TINY_PORTS = dict(port=18000, engine_base_port=18100, side_channel_base_port=15600)
#: Short per-stage deadlines (the tiny model answers in well under a second), so the stall
#: tests in test_faults.py meet them quickly.
PREFILL_DEADLINE_S, HEADERS_DEADLINE_S, IDLE_DEADLINE_S = 6.0, 10.0, 6.0
STAGE_DEADLINES = ["--prefill-deadline-s", str(PREFILL_DEADLINE_S),
                   "--headers-deadline-s", str(HEADERS_DEADLINE_S),
                   "--idle-deadline-s", str(IDLE_DEADLINE_S)]


@pytest.fixture(scope="package")
def tiny_stack(tmp_path_factory) -> Stack:
    """`pdserve dev` on the tiny model, always disaggregating. No link reprobes: the policy
    reads no link estimate, and a probe in flight when a test kills an engine adds its own
    fallback to the counts the test checks (seen: `test_prefill_down_serves_local` counted
    two `prefill_unreachable` fallbacks for its one request)."""
    with serving(
        start_dev, model="tiny", log_dir=tmp_path_factory.mktemp("tiny-stack"), model_name="pdserve-tiny",
        extra=["--policy", "disaggregate", "--reprobe-s", "0", "--kv-events-base-port", "15700",
               "--kv-blocks", "512", *STAGE_DEADLINES], **TINY_PORTS,
        env={"UCX_PROTO_INFO": "y"},  # UCX logs the transport of each operation (test_kv_transport)
    ) as stack:
        yield stack


def pytest_collection_modifyitems(items):
    mark_e2e(items, "e2e")
