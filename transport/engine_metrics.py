"""The one reader of a vLLM engine's ``/metrics``: Prometheus text into typed values.

:func:`sample_sums` parses the text with ``prometheus_client``'s parser and sums every sample
over its labels, by sample name (``vllm:prompt_tokens_total``, ``vllm:nixl_xfer_time_seconds_sum``
...). :func:`engine_load` reads the few series the proxy routes by into a frozen
:class:`EngineLoad`; it parses only their lines (the proxy reads every engine every second, on
its event loop, and a whole vLLM page is tens of kilobytes of histograms). A series absent
from the page reads 0; one read as NaN or infinite (an engine's bug, a torn page) reads None:
it tells nothing, and the reader keeps what it knew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
FINISHED = "vllm:request_success_total"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_SECONDS = "vllm:nixl_xfer_time_seconds_sum"
NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
#: Pulls NIXL gave up on; vLLM then computes the prompt itself (``kv_load_failure_policy``).
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
_LOAD_SERIES = (RUNNING, WAITING, PROMPT_TOKENS, FINISHED, NIXL_BYTES, NIXL_SECONDS,
                NIXL_TRANSFERS, NIXL_FAILED)


@dataclass(frozen=True)
class EngineLoad:
    """What one look at an engine's metrics says about its load (every series summed over its
    labels; counters are totals since the engine started). None: the page gave no finite
    figure for it."""

    requests_running: float | None = 0.0
    requests_waiting: float | None = 0.0
    prompt_tokens: float | None = 0.0
    requests_finished: float | None = 0.0
    #: NIXL's own view of the KV this (decode) engine pulled: bytes, wire seconds, transfers.
    nixl_bytes: float | None = 0.0
    nixl_seconds: float | None = 0.0
    nixl_transfers: float | None = 0.0
    nixl_failed: float | None = 0.0

    @property
    def requests(self) -> int | None:
        """Running + waiting (None when either is unknown)."""
        if self.requests_running is None or self.requests_waiting is None:
            return None
        return int(self.requests_running + self.requests_waiting)


def sample_sums(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page summed over its label sets, by sample name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def engine_load(text: str) -> EngineLoad:
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_LOAD_SERIES))
    sums = sample_sums(lines + "\n") if lines else {}

    def read(name: str) -> float | None:
        value = sums.get(name, 0.0)
        return value if math.isfinite(value) else None

    return EngineLoad(
        requests_running=read(RUNNING), requests_waiting=read(WAITING),
        prompt_tokens=read(PROMPT_TOKENS), requests_finished=read(FINISHED),
        nixl_bytes=read(NIXL_BYTES), nixl_seconds=read(NIXL_SECONDS),
        nixl_transfers=read(NIXL_TRANSFERS), nixl_failed=read(NIXL_FAILED))
