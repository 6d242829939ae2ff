"""Health probes: what one probe of an engine asks, and what its answer means.

A probe asks the engine's ``/health`` (or, of an engine whose requests stalled, for one
generated token: ``proxy/stalls.py``), then reads its metrics (``EnginePool.look``), and sets
its health. A refused connection or a failed request marks it down at once; a slow answer only
in a run of :data:`SLOW_PROBES_TO_MARK_DOWN`, or when not even a TCP connection opens. The loop
probes each engine at its own pace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from proxy.engine import Engine
from proxy.engine_client import EngineTimeout, EngineUnreachable
from proxy.stalls import generates

if TYPE_CHECKING:
    from proxy.pool import EnginePool

log = logging.getLogger(__name__)
SLOW_PROBES_TO_MARK_DOWN = 3


async def probe(pool: EnginePool, engine: Engine) -> bool:
    """Health check, then a look at the engine's own metrics. Raises nothing (but a cancel):
    anything unforeseen is logged and the probe failed, so that one engine's odd answer
    cannot stop the probing of the others."""
    try:
        if engine.silent and pool.probe_model is not None:  # (its /health answers)
            ok = await generates(engine, pool.probe_model)
            if ok:  # it generates: not hung
                engine.stalls, engine.silent, engine.silent_down_at = 0, False, None
            elif engine.healthy:
                engine.silent_down_at = time.monotonic()
                log.warning("engine %s (%s): its requests stalled and it generated no token "
                            "when asked: marked down (a hung engine core?) until it does",
                            engine.name, engine.role)
        else:
            status, _ = await engine.client.get_text("/health", pool.health_timeout_s)
            ok = status == 200
        if ok:
            await pool.look(engine)
    except EngineUnreachable:
        ok = False
    except EngineTimeout:
        # A busy engine can answer a probe late; only a run of slow probes takes it out
        # (a refused connection or a failed request still marks it down at once). Its
        # kernel still accepts a new connection, though: when not even that opens, the
        # engine is cut off (a partition, a host gone silent), and it is down now.
        engine.slow_probes += 1
        if (engine.healthy and engine.slow_probes < SLOW_PROBES_TO_MARK_DOWN
                and await engine.client.connects(pool.health_timeout_s)):
            return True
        ok = False
    except Exception:
        log.exception("probe of engine %s failed; counted as a failed look", engine.name)
        ok = False
    else:
        engine.slow_probes = 0
    pool.set_health(engine, ok)
    return ok


async def run_health_loop(pool: EnginePool, interval_s: float) -> None:
    """Probe every engine each ``interval_s`` (the caller has probed them once already),
    each at its own pace: a probe that waits out the health timeout delays only its own
    engine's next one, never the others'."""
    probing: dict[Engine, asyncio.Task] = {}
    try:
        while True:
            await asyncio.sleep(interval_s)
            probing = {e: task for e, task in probing.items() if not task.done()}
            for e in pool.all():
                if e not in probing:
                    probing[e] = asyncio.create_task(pool.probe(e))
    finally:
        for task in probing.values():
            task.cancel()
