"""Admission control: at most ``max_inflight`` requests are served at once; up to ``max_queued``
more wait (first come, first served) for at most ``queue_timeout_s``; anyone beyond that is
refused at once with 503 and ``Retry-After``.

Call order: ``await acquire()`` then exactly one ``release()`` (in a ``finally``; for a stream,
when the stream ends). ``acquire`` raises ``Overloaded`` and then holds nothing.
"""

from __future__ import annotations

import asyncio

from proxy.errors import Overloaded


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, queue_timeout_s: float):
        self._slots = asyncio.Semaphore(max_inflight)
        self._max_queued = max_queued
        self._queue_timeout_s = queue_timeout_s
        self.queued = 0
        self.inflight = 0

    async def acquire(self) -> None:
        if self._slots.locked():
            if self.queued >= self._max_queued:
                raise Overloaded("the server is at capacity; retry shortly", retry_after_s=1)
            self.queued += 1
            try:
                async with asyncio.timeout(self._queue_timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise Overloaded("the server is at capacity; retry shortly",
                                 retry_after_s=2) from None
            finally:
                self.queued -= 1
        else:
            await self._slots.acquire()
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1
        self._slots.release()
