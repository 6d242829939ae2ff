"""What ``pdserve dev`` and ``pdserve ray`` do for observability: always keep the targets file
current (any Prometheus can scrape the deployment with :func:`~.prometheus.scrape_config`);
with ``--observability`` also run a Prometheus on it, stopped with the deployment."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from launch.observability.prometheus import DASHBOARD, Prometheus
from launch.observability.targets import EngineTarget, TargetsFile


@dataclass(frozen=True)
class ObservabilityOptions:
    #: Start a Prometheus (the ``prometheus`` binary) scraping the deployment.
    prometheus: bool = False
    prometheus_port: int = 9090
    scrape_interval_s: float = 5.0
    #: Where the targets file, the Prometheus config and its data go.
    workdir: Path = Path(".pdserve/observability")


class Observer:
    def __init__(self, opts: ObservabilityOptions, proxy_url: str,
                 engines: Iterable[EngineTarget]):
        self.targets = TargetsFile(opts.workdir / "targets.json", proxy_url)
        self.targets.update(engines)
        self.prometheus: Prometheus | None = None
        if opts.prometheus:
            self.prometheus = Prometheus(opts.workdir, self.targets.path,
                                         port=opts.prometheus_port,
                                         interval_s=opts.scrape_interval_s)
            try:
                self.prometheus.wait_ready()
            except BaseException:
                self.prometheus.stop()
                raise
            print(f"prometheus: {self.prometheus.url} (scraping {self.targets.path}); "
                  f"Grafana dashboard: {DASHBOARD}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
