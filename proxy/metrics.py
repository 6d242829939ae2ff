"""The proxy process's one metrics module (Prometheus). Names: ``pd_<noun>_<unit|total>``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


#: The label values the proxy's code uses (created at start-up; see ``ProxyMetrics``).
FALLBACK_REASONS = ("prefill_error", "prefill_unreachable", "prefill_lost", "prefill_timeout",
                    "bad_handoff", "decode_retried", "handoff_maybe_read", "handoff_expired",
                    "handoff_refused")
STREAM_ERROR_REASONS = ("decode_lost", "decode_error", "decode_timeout", "deadline")
MIGRATION_REASONS = ("decode_lost", "decode_error", "decode_timeout")
#: Why a stream was not continued: off, past the limit, budget or prompt not known, no engine
#: left, or what ``migration.not_migratable`` names.
MIGRATION_FAILURE_REASONS = ("disabled", "limit", "unknown_budget", "unknown_prompt",
                             "no_engine", "logprobs", "echo", "stop_strings",
                             "structured_output", "multimodal", "batch")
REJECTION_TYPES = ("invalid_request_error", "authentication_error", "not_found_error",
                   "overloaded_error", "timeout_error")
DISCONNECT_STAGES = ("before_response", "after_prefill", "streaming")
MIGRATION_STAGES = ("resumed", "first_token")

_M = TypeVar("_M", Counter, Gauge, Histogram)


class Labelled(Generic[_M]):
    """A labelled metric whose children are made once per label values: prometheus_client's
    ``labels()`` checks the values and takes a lock on every call (1.8 µs here), and a request
    asks for about ten of them on its path."""

    __slots__ = ("metric", "_children")

    def __init__(self, metric: _M) -> None:
        self.metric: _M = metric
        self._children: dict[tuple[object, ...], _M] = {}

    def labels(self, *values: object) -> _M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def remove(self, *values: str) -> None:
        for key in [k for k in self._children if tuple(map(str, k)) == values]:
            del self._children[key]
        self.metric.remove(*values)

    def collect(self) -> Iterable[Metric]:
        return self.metric.collect()


class ProxyMetrics:
    """All series one proxy exports; a fresh registry per instance keeps tests independent."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_total = Labelled(Counter(
            "pd_requests_total", "Finished requests by endpoint, route and HTTP status.",
            ["endpoint", "route", "status"], registry=r,
        ))
        self.decisions_total = Labelled(Counter(
            "pd_decisions_total", "Routing decisions by route and reason.",
            ["route", "reason"], registry=r,
        ))
        self.fallbacks_total = Labelled(Counter(
            "pd_fallbacks_total",
            "Disaggregated requests served locally after a failure, by reason.",
            ["reason"], registry=r,
        ))
        self.rejected_total = Labelled(Counter(
            "pd_rejected_total", "Requests refused before reaching an engine, by error type.",
            ["type"], registry=r,
        ))
        self.stream_errors_total = Labelled(Counter(
            "pd_stream_errors_total", "Streams ended with an in-band error, by reason.",
            ["reason"], registry=r,
        ))
        self.migrations_total = Labelled(Counter(
            "pd_migrations_total", "Requests continued on another decode engine after theirs"
            " was lost mid-answer, by what happened to it.", ["reason"], registry=r,
        ))
        self.migrations_failed_total = Labelled(Counter(
            "pd_migrations_failed_total", "Mid-answer decode failures not continued elsewhere"
            " (the client got the error), by why not.", ["reason"], registry=r,
        ))
        self.migration_seconds = Labelled(Histogram(
            "pd_migration_seconds", "A stream continued on another decode engine: from its"
            " engine's loss to the continuation's response headers (resumed) and to its first"
            " relayed bytes (first_token): the extra gap its client saw.",
            ["stage"], buckets=_LATENCY_BUCKETS_S, registry=r,
        ))
        self.client_disconnects_total = Labelled(Counter(
            "pd_client_disconnects_total", "Requests whose client went away before the end.",
            ["stage"], registry=r,
        ))
        self.stage_seconds = Labelled(Histogram(
            "pd_stage_seconds", "Time per stage: prefill, handover (prefill done -> decode first"
            " byte), ttft (request in -> first byte out), total.",
            ["stage", "route"], buckets=_LATENCY_BUCKETS_S, registry=r,
        ))
        self.ttft_prediction_ratio = Labelled(Histogram(
            "pd_ttft_prediction_ratio", "Measured / predicted time to first token, by route"
            " (1.0 = the cost model was exact).",
            ["route"], buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
            registry=r,
        ))
        self.itl_prediction_ratio = Labelled(Histogram(
            "pd_itl_prediction_ratio", "Measured / predicted longest gap between the tokens of"
            " the streams decoding beside an arrival, by the arrival's route.",
            ["route"], buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
            registry=r,
        ))
        self.inflight_requests = Gauge(
            "pd_inflight_requests", "Requests being served now.", registry=r,
        )
        self.queued_requests = Gauge(
            "pd_queued_requests", "Requests waiting for a slot (admission control).",
            registry=r,
        )
        self.event_loop_lag_seconds = Histogram(
            "pd_event_loop_lag_seconds", "How late the event loop ran a timer due now: how long"
            " one piece of work held the loop (every request and stream waits that long).",
            buckets=(0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                     0.5, 1.0, 2.5),
            registry=r,
        )
        self.engine_up = Labelled(Gauge(
            "pd_engine_up", "1 when the engine answers its health check.",
            ["role", "engine"], registry=r,
        ))
        self.engine_replacements_total = Labelled(Counter(
            "pd_engine_replacements_total", "Engines started in place of engines dead for good"
            " (Ray mode: restarts exhausted, or a restart that never became ready).",
            ["role"], registry=r,
        ))
        self.itl_seconds = Labelled(Histogram(
            "pd_itl_seconds", "Time between the relayed events of a stream, per token, by route"
            " (the inter-token latency the client sees).",
            ["route"], buckets=_LATENCY_BUCKETS_S, registry=r,
        ))
        self.handover_seconds = Labelled(Histogram(
            "pd_handover_seconds", "Prefill done -> decode's first byte, per prefill -> decode"
            " pair (the KV pull and the decode engine's first step).",
            ["prefill", "decode"], buckets=_LATENCY_BUCKETS_S, registry=r,
        ))
        self.kv_pull_failures_total = Labelled(Counter(
            "pd_kv_pull_failures_total", "KV pulls a decode engine's NIXL reported failed; the"
            " engine then computed the prompt itself (vLLM's kv_load_failure_policy=recompute),"
            " so the request was served, at a prefill's cost twice.",
            ["engine"], registry=r,
        ))
        self.kv_moved_bytes_total = Labelled(Counter(
            "pd_kv_moved_bytes_total", "KV bytes decode engines pulled, per prefill -> decode"
            " pair (prompt tokens not cached on decode x KV bytes per token).",
            ["prefill", "decode"], registry=r,
        ))
        # Labelled counters have no series until first incremented: the known label sets exist
        # from the start, so a dashboard shows 0, not "no data", before the first failure.
        for counter, labels in ((self.fallbacks_total, FALLBACK_REASONS),
                                (self.stream_errors_total, STREAM_ERROR_REASONS),
                                (self.migrations_total, MIGRATION_REASONS),
                                (self.migrations_failed_total, MIGRATION_FAILURE_REASONS),
                                (self.rejected_total, REJECTION_TYPES),
                                (self.client_disconnects_total, DISCONNECT_STAGES),
                                (self.engine_replacements_total, ("prefill", "decode"))):
            for label in labels:
                counter.labels(label)
        for stage in MIGRATION_STAGES:  # a dashboard reads "no migration", not "no data"
            self.migration_seconds.labels(stage)

    def forget_engine(self, name: str) -> None:
        """Drop the series of an engine gone for good: its ``pd_engine_up`` and the series of
        its pairs (Ray mode's names only grow: each scale-down would leave one more
        ``pd_engine_up`` at 0, for an engine that no longer exists)."""
        for metric, labels in ((self.engine_up, ("role", "engine")),
                               (self.kv_pull_failures_total, ("engine",)),
                               (self.handover_seconds, ("prefill", "decode")),
                               (self.kv_moved_bytes_total, ("prefill", "decode"))):
            for family in metric.collect():
                for values in {tuple(s.labels[k] for k in labels) for s in family.samples}:
                    named = dict(zip(labels, values))
                    if name in (named.get("engine"), named.get("prefill"), named.get("decode")):
                        metric.remove(*values)
