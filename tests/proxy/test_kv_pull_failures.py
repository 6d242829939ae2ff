"""A KV pull that fails is served anyway (vLLM's ``kv_load_failure_policy=recompute``: the
decode engine computes the prompt itself), so nothing the client sees tells. The proxy reads
the decode engine's own count of failed pulls each probe, counts the new ones in
``pd_kv_pull_failures_total{engine}``, shows the total in ``/pd/costs`` and logs a warning.
(Seen for real on two nodes whose model paths differed: every pull failed NIXL's
compatibility check.)"""

from __future__ import annotations

import logging

from proxy.metrics import ProxyMetrics
from proxy.pool import EnginePool


class MetricsClient:
    """An engine that is up and whose NIXL has failed ``failed`` pulls so far."""

    base_url = "http://x"

    def __init__(self, name: str = "decode-0"):
        self.name = name
        self.failed = 0

    async def get_text(self, path, timeout_s):
        if path == "/health":
            return 200, ""
        return 200, (f'vllm:nixl_num_failed_transfers_total{{engine="0"}} {self.failed}.0\n'
                     'vllm:num_requests_running{engine="0"} 0.0\n')


def failures(metrics: ProxyMetrics, engine: str) -> float:
    return metrics.registry.get_sample_value("pd_kv_pull_failures_total", {"engine": engine})


async def test_new_failed_pulls_are_counted_and_logged_once_each(caplog):
    client, metrics = MetricsClient(), ProxyMetrics()
    pool = EnginePool([], [client], metrics)
    (engine,) = pool.decode
    client.failed = 3  # before the proxy first looked: the baseline, not counted
    await pool.probe(engine)
    # The series is there from the first look, at 0 (a dashboard panel shows it).
    assert engine.kv_pull_failures == 0 and failures(metrics, "decode-0") == 0
    client.failed = 5
    with caplog.at_level(logging.WARNING, logger="proxy.pool"):
        await pool.probe(engine)
        await pool.probe(engine)  # nothing new: nothing more counted or logged
    assert engine.kv_pull_failures == 2 and failures(metrics, "decode-0") == 2
    warnings = [r for r in caplog.records if "KV pull(s) failed" in r.getMessage()]
    assert len(warnings) == 1 and "decode-0: 2 KV pull(s)" in warnings[0].getMessage()


async def test_a_prefill_engine_has_no_pull_failure_series():
    """Only decode engines pull KV."""
    client, metrics = MetricsClient("prefill-0"), ProxyMetrics()
    pool = EnginePool([client], [], metrics)
    await pool.probe(pool.prefill[0])
    assert failures(metrics, "prefill-0") is None
