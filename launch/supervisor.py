"""Restart dev mode's engines when they die, the way Ray restarts an engine actor.

A background thread per engine looks at it twice a second (a check of one engine can wait out
its ``/health`` for up to 5 s: it holds up no other engine's). One that exited while dev mode
was running is started again with the same spec (same ports, so the proxy finds it at the same
url; the proxy marks it down on its first failed call or probe, and warms the new engine up with
its peers before routing to it again). An engine that keeps dying soon after starting, or before
it ever answered ``/health`` (however long its start-up took), or that cannot be started at all,
is in a crash loop: it is restarted with a growing pause, and after ``max_quick_deaths`` such
deaths in a row it is left down with its last log line reported (dev mode keeps serving what it
can: with the prefill engine down every request is served ``local``). An engine that is alive
but hung (its ``/health`` unanswered past ``hang_timeout_s``, by the rule of
``launch/engine_hang.py``, as Ray mode's watchdog judges it) is killed, and so restarted like
one that died; so is one whose core the proxy found hung behind a live ``/health``
(:meth:`Supervisor.restart`, ``proxy/stalls.py``). Nothing one engine does ends the watch: a
failure is logged and the thread carries on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from launch.engine_hang import HangDetector
from launch.isolation import guard
from launch.processes import EngineProcess, start_engine, stop_engines

log = logging.getLogger(__name__)
#: How often the engines' trees are checked for threads that left their cores.
GUARD_EVERY_S = 10.0


@dataclass
class _Watch:
    started: float
    #: It answered ``/health`` since it was last started.
    ready: bool = False
    quick_deaths: int = 0
    retry_at: float | None = None
    gave_up: bool = False
    #: Judges it hung once ready (None: not watched for hangs).
    hang: HangDetector | None = None


class Supervisor:
    """Keeps ``engines`` (a list the caller also stops at shutdown) running.

    Entries are replaced in place when an engine is restarted; ``on_restart`` is called with
    the list afterwards (dev mode rewrites its run file)."""

    def __init__(
        self,
        engines: MutableSequence[EngineProcess],
        log_dir: Path,
        on_restart: Callable[[MutableSequence[EngineProcess]], None] | None = None,
        start: Callable[[EngineProcess], EngineProcess] | None = None,
        quick_s: float = 120.0,
        max_quick_deaths: int = 3,
        poll_s: float = 0.5,
        hang_timeout_s: float = 0.0,
    ):
        self.engines = engines
        self._start = start or (lambda dead: start_engine(dead.spec, log_dir, append_log=True))
        self._on_restart = on_restart
        self._quick_s = quick_s
        self._max_quick_deaths = max_quick_deaths
        self._poll_s = poll_s
        self._hang_timeout_s = hang_timeout_s
        self._watch = {i: self._new_watch(time.monotonic()) for i in range(len(engines))}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-supervisor", daemon=True)
        self._watchers = [threading.Thread(target=self._watch_one, args=(i,), daemon=True,
                                           name=f"engine-supervisor-{i}")
                          for i in range(len(engines))]
        self._restarted = threading.Lock()  # (the count and ``on_restart``: one at a time)
        self.restarts = 0

    def start(self) -> Supervisor:
        for t in (*self._watchers, self._thread):
            t.start()
        return self

    def stop(self) -> None:
        """Stop watching (before the engines are stopped, so none is restarted meanwhile)."""
        self._stop.set()
        deadline = time.monotonic() + 10
        for t in (self._thread, *self._watchers):
            if t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))

    def _watch_one(self, i: int) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.check(i, time.monotonic())
            except Exception:  # one engine's bad moment must not end its watch
                log.exception("supervising %s failed", self.engines[i].name)

    def _run(self) -> None:
        while not self._stop.wait(GUARD_EVERY_S):  # threads that moved themselves off their cores
            try:
                guard(((e.name, e.popen.pid, e.spec.cpu_cores) for e in self.engines
                       if e.alive()), log.warning)
            except Exception:
                log.exception("checking the engines' cores failed")

    def check(self, i: int, now: float) -> None:
        """Look at engine ``i`` at time ``now``: note a death, restart when its pause is over."""
        engine, watch = self.engines[i], self._watch[i]
        if watch.gave_up or self._stop.is_set():
            return
        if engine.alive():
            if not watch.ready:  # until it answers once, a death is a failed start
                watch.ready = engine.healthy()
            elif watch.hang is not None and watch.hang.poll(engine.healthy, now):
                log.error("%s alive (pid %d) but %s: killing it to restart it", engine.name,
                          engine.popen.pid, watch.hang.why(now))
                stop_engines([engine], grace_s=0.0)
            return
        if watch.retry_at is None:  # just found dead
            log.warning("%s exited with code %s: %r", engine.name,
                        engine.popen.returncode, engine.root_cause())
            # Quick: soon after its start, or before it ever served (a start-up longer than
            # quick_s, a big model's load, ends in the same crash every time).
            quick = not watch.ready or now - watch.started < self._quick_s
            if not self._died(engine, watch, now, quick):
                return
            stop_engines([engine], grace_s=2.0)  # whatever is left of its process group
        if watch.retry_at is None or now < watch.retry_at:
            return
        watch.retry_at = None
        watch.started, watch.ready = now, False
        watch.hang = self._new_watch(now).hang
        try:
            self.engines[i] = self._start(engine)
        except Exception:  # fork failing (EAGAIN), its log dir gone: a start that failed at once
            log.exception("restarting %s failed", engine.name)
            self._died(engine, watch, now, quick=True)
            return
        log.warning("%s restarted (pid %d)", engine.name, self.engines[i].popen.pid)
        with self._restarted:
            self.restarts += 1
            if self._on_restart is not None:
                try:
                    self._on_restart(self.engines)
                except Exception:
                    log.exception("after restarting %s", engine.name)

    def _new_watch(self, now: float) -> _Watch:
        hang = HangDetector(self._hang_timeout_s) if self._hang_timeout_s > 0 else None
        return _Watch(now, hang=hang)

    def kill_serving(self, url: str) -> bool:
        """Kill the engine serving ``url`` (the proxy found its core hung behind a live API
        server, which no hang check of its /health sees), so that it is restarted like one
        that died. False when no live engine serves ``url``."""
        port = urlsplit(url).port
        for engine in list(self.engines):
            if engine.spec.port == port and engine.alive():
                log.error("%s: killing it to restart it (its core hung: the proxy's requests "
                          "stalled and it generated no token)", engine.name)
                stop_engines([engine], grace_s=0.0)
                return True
        return False

    async def restart(self, name: str, url: str) -> None:
        """The proxy's ``Restarter`` (``proxy/directory.py``): :meth:`kill_serving`, off the
        proxy's event loop."""
        if not await asyncio.to_thread(self.kill_serving, url):
            log.warning("asked to restart %s (%s): no live engine serves it", name, url)

    def _died(self, engine: EngineProcess, watch: _Watch, now: float, quick: bool) -> bool:
        """Count a death; schedule the restart (True) or leave the engine down (False)."""
        watch.quick_deaths = watch.quick_deaths + 1 if quick else 1
        if watch.quick_deaths > self._max_quick_deaths:
            watch.gave_up = True
            log.error("%s died %d times soon after starting: left down (log: %s)",
                      engine.name, watch.quick_deaths, engine.log_path)
            return False
        watch.retry_at = now + min(30.0, 2.0 ** (watch.quick_deaths - 1))
        return True

