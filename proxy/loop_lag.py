"""A probe of the proxy's own event loop: how late a timer that is due runs.

Anything that holds the loop (a long tokenization, a big JSON document, a blocking call) delays
every request and every relayed stream by as long; this probe sees it as the lateness of its own
wake-ups and records it in ``pd_event_loop_lag_seconds``. A stall overlapping a wake-up is
measured; one shorter than the interval, falling between two wake-ups, is missed. The task runs
until cancelled.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram


async def watch_loop_lag(histogram: Histogram, interval_s: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        histogram.observe(max(0.0, loop.time() - due))
