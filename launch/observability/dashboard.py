"""The Grafana dashboard, written once as a table of panels and generated as JSON
(``dashboard.json``, committed for import: ``python -m launch.observability.dashboard`` rewrites
it; a test checks it is current). Plain JSON in Grafana's schema, no builder library: the
panels are a dozen lines of PromQL each, and the table below is what a reviewer reads.

``$__rate_interval`` is Grafana's; the real-Prometheus test substitutes a window for it."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from launch.observability.prometheus import DASHBOARD

RATE = "$__rate_interval"


def quantiles(metric: str, by: str, where: str = "", qs: tuple[float, ...] = (0.5, 0.99)
              ) -> tuple[tuple[str, str], ...]:
    """p50/p99 of a histogram by ``by`` (one line per value)."""
    sel = f"{metric}_bucket{{{where}}}" if where else f"{metric}_bucket"
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return tuple((f"histogram_quantile({q:g}, sum by (le, {by}) (rate({sel}[{RATE}])))",
                  f"p{q * 100:g} {legend}") for q in qs)


def rates(metric: str, by: str) -> tuple[str, str]:
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return (f"sum by ({by}) (rate({metric}[{RATE}]))", f"{metric.removeprefix('pd_')} {legend}")


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""


PANELS: tuple[Panel, ...] = (
    Panel("Time to first token by route", "s",
          quantiles("pd_stage_seconds", "route", 'stage="ttft"'),
          "Request in -> first byte out, as the proxy's clients see it."),
    Panel("Inter-token latency by route", "s", quantiles("pd_itl_seconds", "route"),
          "Time between the relayed events of a stream, per token."),
    Panel("Requests by route and status", "reqps",
          (rates("pd_requests_total", "route, status"),)),
    Panel("Routing decisions by reason", "reqps",
          (rates("pd_decisions_total", "route, reason"),),
          "Why each request went local or disaggregated (proxy/policy.py)."),
    Panel("Measured / predicted TTFT", "none",
          quantiles("pd_ttft_prediction_ratio", "route", qs=(0.5,)),
          "1 = the cost model was exact; > 1: slower than it predicted."),
    Panel("Measured / predicted ITL beside an arrival", "none",
          quantiles("pd_itl_prediction_ratio", "route", qs=(0.5,)),
          "The longest gap of the streams decoding beside an arrival, against the prediction "
          "the SLO rule made for it."),
    Panel("Hand-over per prefill -> decode pair", "s",
          quantiles("pd_handover_seconds", "prefill, decode"),
          "Prefill done -> decode's first byte: the KV pull and the first step."),
    Panel("KV pull rate per pair", "Bps", (
        (f"sum by (prefill, decode) (rate(pd_kv_moved_bytes_total[{RATE}])) / "
         f"sum by (prefill, decode) (rate(pd_handover_seconds_sum[{RATE}]))",
         "{{prefill}} -> {{decode}} (hand-over)"),
        (f"sum by (pd_engine) (rate(vllm:nixl_bytes_transferred_sum[{RATE}])) / "
         f"sum by (pd_engine) (rate(vllm:nixl_xfer_time_seconds_sum[{RATE}]))",
         "{{pd_engine}} (NIXL wire time)")),
          "KV bytes per second of hand-over, and NIXL's own rate on each pulling engine."),
    Panel("Engine queues", "short", (
        ("sum by (pd_engine) (vllm:num_requests_running)", "running {{pd_engine}}"),
        ("sum by (pd_engine) (vllm:num_requests_waiting)", "waiting {{pd_engine}}"))),
    Panel("KV cache usage", "percentunit", (
        ("max by (pd_engine) (vllm:kv_cache_usage_perc)", "{{pd_engine}}"),)),
    Panel("Prompt tokens by source", "short", (
        rates("vllm:prompt_tokens_by_source_total", "pd_engine, source"),),
          "Computed here, from the prefix cache, or from outside (a NIXL pull or the offload "
          "tier)."),
    Panel("Offload tier hits", "short", (
        rates("vllm:external_prefix_cache_hits_total", "pd_engine"),
        rates("vllm:external_prefix_cache_queries_total", "pd_engine")),
          "Tokens asked of and found in the connectors' stores (the CPU tier; a NIXL pull "
          "counts on a decode engine)."),
    Panel("Fallbacks, stream errors, migrations, failed KV pulls", "reqps", (
        rates("pd_fallbacks_total", "reason"), rates("pd_stream_errors_total", "reason"),
        rates("pd_migrations_total", "reason"), rates("pd_kv_pull_failures_total", "engine")),
          "A failed KV pull is recomputed by its decode engine: the client is served, at a "
          "second prefill's cost (the engine's vLLM log says why)."),
    Panel("Migration gap", "s", quantiles("pd_migration_seconds", "stage"),
          "A stream continued on another decode engine: its engine's loss to the "
          "continuation's headers (resumed) and first bytes (first_token)."),
    Panel("Client disconnects and admission rejections", "reqps", (
        rates("pd_client_disconnects_total", "stage"), rates("pd_rejected_total", "type"))),
    Panel("Engines up", "short", (
        ("max by (role, engine) (pd_engine_up)", "{{role}} {{engine}} (proxy's probe)"),
        ('max by (pd_engine) (up{role!="proxy"})', "{{pd_engine}} (scrape)"),
        ("sum by (role) (pd_engine_replacements_total)", "{{role}} engines replaced")),
          "Up by the proxy's probes and by Prometheus's scrapes; engines started in place of "
          "engines dead for good since the proxy started (Ray mode)."),
    Panel("Proxy: in flight and event-loop lag", "short", (
        ("sum(pd_inflight_requests)", "in flight"),
        (f"histogram_quantile(0.99, sum by (le) (rate(pd_event_loop_lag_seconds_bucket[{RATE}])))",
         "loop lag p99 (s)"))),
)


def expressions() -> list[str]:
    return [expr for panel in PANELS for expr, _ in panel.targets]


def dashboard() -> dict[str, Any]:
    panels = []
    for i, p in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": p.title, "description": p.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(p.targets)],
        })
    return {
        "title": "pdserve", "uid": "pdserve", "schemaVersion": 39, "version": 1,
        "tags": ["pdserve", "vllm", "disaggregated"], "timezone": "browser",
        "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    DASHBOARD.write_text(render())
    print(f"wrote {DASHBOARD} ({len(PANELS)} panels)", file=sys.stderr)
