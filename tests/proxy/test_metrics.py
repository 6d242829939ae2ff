"""The proxy's labelled metrics: children made once, and a removed series that comes back is
exported again (not a stale child kept by the cache)."""

from __future__ import annotations

from proxy.metrics import ProxyMetrics


def test_a_labelled_child_is_made_once_per_label_values(monkeypatch):
    """prometheus_client's ``labels()`` (its checks and lock) runs once per label values."""
    metrics = ProxyMetrics()
    made: list[tuple[str, ...]] = []
    inner = metrics.stage_seconds.metric.labels
    monkeypatch.setattr(metrics.stage_seconds.metric, "labels",
                        lambda *values: made.append(values) or inner(*values))
    child = metrics.stage_seconds.labels("ttft", "local")
    assert metrics.stage_seconds.labels("ttft", "local") is child
    assert metrics.stage_seconds.labels("ttft", "disaggregated") is not child
    assert made == [("ttft", "local"), ("ttft", "disaggregated")]
    child.observe(0.5)
    assert metrics.registry.get_sample_value(
        "pd_stage_seconds_count", {"stage": "ttft", "route": "local"}) == 1


def test_a_series_removed_and_used_again_is_exported_again():
    """An engine gone and back under the same name (``forget_engine`` then a new request)."""
    metrics = ProxyMetrics()
    labels = {"prefill": "prefill-0", "decode": "decode-1"}
    metrics.kv_moved_bytes_total.labels("prefill-0", "decode-1").inc(10)
    metrics.forget_engine("decode-1")
    assert metrics.registry.get_sample_value("pd_kv_moved_bytes_total", labels) is None
    metrics.kv_moved_bytes_total.labels("prefill-0", "decode-1").inc(3)
    assert metrics.registry.get_sample_value("pd_kv_moved_bytes_total", labels) == 3
