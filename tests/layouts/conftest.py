"""One `pdserve dev --layout aggregated` stack on the tiny model: two engines alike (vLLM's
``kv_both``), started after tests/e2e stopped its stacks (one set of engines at a time)."""

from __future__ import annotations

import pytest

from harness.stack import Stack, serving, start_dev
from tests.marks import last_in_package, mark_e2e

#: An engine frozen this long is killed (and restarted) by dev mode's supervisor: longer than
#: the migration test's freeze takes to matter (its mark-down, ~9 s), short for CI.
HANG_TIMEOUT_S = 12.0
#: A stream silent this long stalled (60 s by default): what a hung engine core behind a live
#: API server is found by (``proxy/stalls.py``); far above any gap of the tiny model's.
IDLE_DEADLINE_S = 25.0


@pytest.fixture(scope="package")
def pool_stack(tmp_path_factory) -> Stack:
    with serving(
        start_dev, model="tiny", port=18500, engine_base_port=18600, side_channel_base_port=16600,
        log_dir=tmp_path_factory.mktemp("pool-stack"), model_name="pdserve-tiny",
        extra=["--layout", "aggregated", "--kv-events-base-port", "16700", "--kv-blocks",
               "512", "--reprobe-s", "0", "--hang-timeout-s", str(HANG_TIMEOUT_S),
               "--idle-deadline-s", str(IDLE_DEADLINE_S)],
    ) as stack:
        yield stack


def pytest_collection_modifyitems(items):
    mark_e2e(items, "layouts")
    # Its kills leave an engine restarting: nothing after them waits for that.
    last_in_package(items, "/layouts/test_migration_e2e.py")
