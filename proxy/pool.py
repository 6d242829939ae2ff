"""The set of prefill and decode engines the proxy routes across, with health and load.

Health is probed in the background and marked down at once on a failed call. Load is the number
of requests this proxy has in flight on each engine. ``pick_*`` return the least-loaded healthy
engine, or None.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from proxy.engine_client import EngineClient, EngineTimeout, EngineUnreachable
from proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)
Role = Literal["prefill", "decode"]


@dataclass(eq=False)
class Engine:
    role: Role
    client: EngineClient
    healthy: bool = False
    inflight: int = 0
    consecutive_failures: int = field(default=0)

    @property
    def name(self) -> str:
        return self.client.name


class EnginePool:
    def __init__(
        self,
        prefill: Sequence[EngineClient],
        decode: Sequence[EngineClient],
        metrics: ProxyMetrics,
        health_timeout_s: float = 2.0,
    ):
        self.prefill = [Engine("prefill", c) for c in prefill]
        self.decode = [Engine("decode", c) for c in decode]
        self._metrics = metrics
        self._health_timeout_s = health_timeout_s

    def all(self) -> list[Engine]:
        return [*self.prefill, *self.decode]

    def pick_prefill(self) -> Engine | None:
        return _least_loaded(self.prefill)

    def pick_decode(self) -> Engine | None:
        return _least_loaded(self.decode)

    @property
    def ready(self) -> bool:
        """A decode engine is up, and so is a prefill engine if any are configured."""
        prefill_ok = not self.prefill or any(e.healthy for e in self.prefill)
        return any(e.healthy for e in self.decode) and prefill_ok

    @contextmanager
    def using(self, engine: Engine) -> Iterator[Engine]:
        engine.inflight += 1
        try:
            yield engine
        finally:
            engine.inflight -= 1

    def mark_down(self, engine: Engine) -> None:
        if engine.healthy:
            log.warning("engine %s (%s) marked down", engine.name, engine.role)
        self._set_health(engine, False)

    def _set_health(self, engine: Engine, healthy: bool) -> None:
        if healthy and not engine.healthy:
            log.info("engine %s (%s) is up", engine.name, engine.role)
        engine.healthy = healthy
        engine.consecutive_failures = 0 if healthy else engine.consecutive_failures + 1
        self._metrics.engine_up.labels(engine.role, engine.name).set(1 if healthy else 0)

    async def probe(self, engine: Engine) -> bool:
        try:
            status, _ = await engine.client.get_text("/health", self._health_timeout_s)
            ok = status == 200
        except (EngineUnreachable, EngineTimeout):
            ok = False
        self._set_health(engine, ok)
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in self.all()))

    async def run_health_loop(self, interval_s: float) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(interval_s)


def _least_loaded(engines: Sequence[Engine]) -> Engine | None:
    healthy = [e for e in engines if e.healthy]
    return min(healthy, key=lambda e: e.inflight) if healthy else None
