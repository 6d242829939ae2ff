"""Taking engines out of a running deployment without dropping what they serve: which go
(those down first, then the newest), and draining them: they get nothing new, finish what they
have, and past a timeout their streams continue on other engines (stream migration). Used by
``ProxyService.scale``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from proxy.pool import EnginePool

log = logging.getLogger(__name__)

#: After a drain timed out and its streams were cut, how long their continuations may take to
#: leave the engines (their relays end at once; a whole reply being read ends with its engine).
EVACUATE_S = 5.0


def pick_removals(names: Sequence[str], keep: int, up: Callable[[str], bool]) -> list[str]:
    """Which of ``names`` (oldest first) go so that ``keep`` remain: engines that are down
    first (restarting, unreachable, not yet probed: they serve nothing), then the newest.
    Pure; returned oldest first."""
    ranked = sorted(range(len(names)), key=lambda i: (up(names[i]), -i))
    going = set(ranked[:max(len(names) - keep, 0)])
    return [n for i, n in enumerate(names) if i in going]


async def drain(pool: EnginePool, names: Sequence[str], timeout_s: float) -> bool:
    """Drain ``names``: True when they finished everything within ``timeout_s``; False when
    their streams had to be moved (cut: each relay continues its stream elsewhere)."""
    for e in pool.all():
        if e.name in names:
            e.draining = True
    if await wait_idle(pool, names, timeout_s):
        return True
    cut = 0
    for e in pool.all():
        if e.name in names:
            for stream in list(e.open_streams):
                stream.move()  # continued elsewhere; the engine is not marked down for it
                cut += 1
    log.warning("drain of %s timed out: %d streams moved to other engines", ", ".join(names),
                cut)
    await wait_idle(pool, names, EVACUATE_S)
    return False


def undrain(pool: EnginePool, names: Sequence[str]) -> None:
    """A scale-down that failed: those of ``names`` still in the pool take new work again
    (left draining, they would stay idle for good: nothing else clears the mark)."""
    for e in pool.all():
        if e.name in names:
            e.draining = False


async def wait_idle(pool: EnginePool, names: Sequence[str], timeout_s: float) -> bool:
    """Wait until none of ``names`` has a request of this proxy in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while any(e.inflight for e in pool.all() if e.name in names):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True
